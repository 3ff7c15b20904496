"""Run a command with the filesystem a Kubernetes container with `readOnlyRootFilesystem` sees, as its user.

    unshare --mount --propagation private -- python tests/support/pod_sandbox.py SPEC.json

SPEC is JSON: {"volumes": [{"source", "target", "read_only"}], "uid", "gid", "groups", "argv", "env", "cwd",
"scratch"}. In the new mount namespace (nothing changes outside it) each volume's directory is bound at its
target, at the very path the manifest names (a missing mount point is made by laying a tmpfs over its nearest
existing parent, with that parent's entries bound back); every other mount but /proc, /sys and /dev is made
read-only; then the process sets no_new_privs, takes the user and groups (and so loses every capability) and
execs `argv`, keeping its pid. An interpreter under a
directory only root may enter (pyenv in /root) is shown to the user, alone.

Test-only (tests/test_deploy_pod.py); it needs root and CAP_SYS_ADMIN, as `unshare --mount` does.
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

KEEP_WRITABLE = ("/proc", "/sys", "/dev")
PR_SET_NO_NEW_PRIVS = 38


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


def graft(directory: Path, scratch: Path, only: str | None = None) -> None:
    """Lay a tmpfs over `directory` holding its entries (or just `only`), bound back, so new mount points can be
    made in it; its other entries stay as they were."""
    stage = Path(tempfile.mkdtemp(dir=scratch))
    mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(stage))
    for entry in os.scandir(directory):
        if only is not None and entry.name != only:
            continue
        target = stage / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
        elif entry.is_dir():
            target.mkdir()
            mount("--rbind", entry.path, str(target))
        elif entry.is_file():
            target.touch()
            mount("--bind", entry.path, str(target))
    mount("--rbind", str(stage), str(directory))
    subprocess.run(["umount", "--recursive", "--lazy", str(stage)], check=True, capture_output=True)  # the copy stays


def mount_point(target: Path, scratch: Path, grafted: set[Path]) -> None:
    """Make `target` exist in this namespace only: below a graft, never on a filesystem the host shares."""
    if target.exists():
        return
    parent = next(p for p in target.parents if p.exists())
    if not any(parent == g or g in parent.parents for g in grafted):
        graft(parent, scratch)
        grafted.add(parent)
    target.mkdir(parents=True)


def expose_interpreter(scratch: Path) -> None:
    """Show the user the interpreter's tree where an ancestor of it is closed to others (0700 /root)."""
    real = Path(os.path.realpath(sys.executable))
    for closed in reversed(real.parents):
        if closed != Path("/") and not os.stat(closed).st_mode & stat.S_IXOTH:
            graft(closed, scratch, only=real.relative_to(closed).parts[0])
            return


def mounts() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4].replace("\\040", " ") for line in f]


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    scratch = Path(spec["scratch"])
    mount("--make-rprivate", "/")
    expose_interpreter(scratch)
    volumes = spec["volumes"]
    # a target above a source (the pod's /tmp over this sandbox's own directory in /tmp) is bound last
    volumes.sort(key=lambda v: any(Path(v["target"]) in Path(o["source"]).parents for o in volumes))
    grafted: set[Path] = set()
    for v in volumes:
        mount_point(Path(v["target"]), scratch, grafted)
        mount("--bind", v["source"], v["target"])
    writable = {v["target"] for v in volumes if not v["read_only"]}
    for point in mounts():
        if point not in writable and not point.startswith(KEEP_WRITABLE):
            mount("-o", "remount,bind,ro", point)
    os.chdir(spec["cwd"])
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # allowPrivilegeEscalation
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.setgroups(spec["groups"])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
    os.execve(spec["argv"][0], spec["argv"], spec["env"])


if __name__ == "__main__":
    main(sys.argv[1])
