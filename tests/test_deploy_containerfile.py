"""deploy/Containerfile, without building it (these machines reach no image registry): every command it runs is
installed by it or comes with its Debian base, every file it copies is in the repository, its two variants are
one build argument, it agrees with the Kubernetes manifests, and the Makefile target it runs installs a working
daemon in a clean directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support.deploy_helpers import (
    K8S,
    ROOT,
    config_arg,
    container,
    lay_out,
    mount_of,
    mounts,
    pod_spec,
    run_commands,
    stages,
)
from tests.support.kustomize_subset import render
from trio_gpuworker.daemon.config import parse_config

# commands every Debian (and Ubuntu) base image has: dpkg's Essential packages (coreutils, passwd, ...) and apt
ESSENTIAL = {"apt-get", "rm", "install", "groupadd", "useradd", "chown"}
VARIANTS = ("cpu", "cuda")
BUILD, FINAL = "build", "final"


def apt_installed(stage_runs: list[str]) -> set[str]:
    return {w for run in stage_runs for cmd in run_commands(run) if cmd[:2] == ["apt-get", "install"]
            for w in cmd[2:] if not w.startswith("-")}


def test_every_command_is_installed_by_the_file_or_essential() -> None:
    for variant in VARIANTS:
        st = stages({"VARIANT": variant})
        for name in (BUILD, FINAL):
            runs = st[name].all("RUN")
            have = ESSENTIAL | apt_installed(runs)
            for run in runs:
                for cmd in run_commands(run):
                    assert cmd[0] in have, f"{name}: {cmd[0]} is neither installed nor essential"
        # the build stage runs Makefile targets that exist and do what the comment says
        targets = [t for run in st[BUILD].all("RUN") for cmd in run_commands(run) if cmd[0] == "make" for t in cmd[1:]]
        assert targets == ["clean", "image-deps"]
        for target in targets:
            dry = subprocess.run(["make", "-n", "-f", ROOT / "Makefile", target], capture_output=True, text=True,
                                 cwd=ROOT, timeout=60, check=False)
            assert dry.returncode == 0, dry.stderr
        # the entry point: tini from the image's packages, then the venv's gpuworkerd that setup.py installs
        entry = st[FINAL].exec_form("ENTRYPOINT")
        assert entry[:2] == ["/usr/bin/tini", "--"] and "tini" in apt_installed(st[FINAL].all("RUN"))
        (workdir,) = st[BUILD].all("WORKDIR")
        assert entry[2] == f"{workdir}/.venv/bin/gpuworkerd"
        assert "bin/gpuworkerd" in (ROOT / "setup.py").read_text()
        assert [f"--from={BUILD}", f"{workdir}", f"{workdir}"] == st[FINAL].all("COPY")[0].split()


def test_every_copied_file_is_in_the_repository() -> None:
    for variant in VARIANTS:
        st = stages({"VARIANT": variant})
        for name in (BUILD, FINAL):
            for copy in st[name].all("COPY"):
                *sources, _ = copy.replace("${VARIANT}", variant).split()
                if sources[0].startswith("--from="):
                    continue
                for src in sources:
                    assert (ROOT / src).exists(), f"COPY {src}: not in the repository"


def test_the_variants_are_one_build_argument(tmp_path: Path) -> None:
    """VARIANT picks the base (Debian, or NVIDIA's CUDA image) and the default configuration (CPU or CUDA lanes)."""
    bases = set()
    for variant in VARIANTS:
        st = stages({"VARIANT": variant})
        assert st[BUILD].base == st[FINAL].base == f"base-{variant}"
        bases.add(st[f"base-{variant}"].base)
        (config,) = [c.split()[0] for c in st[FINAL].all("COPY") if c.endswith("/etc/gpuworkerd/gpuworkerd.toml")]
        text = (ROOT / config.replace("${VARIANT}", variant)).read_text()
        lanes = tomllib.loads(text)["lanes"]
        assert {ln["device"] for ln in lanes} == {"CPU" if variant == "cpu" else "CUDA"}
        assert st[FINAL].exec_form("CMD") == ["--config", "/etc/gpuworkerd/gpuworkerd.toml"]
    assert bases == {"docker.io/library/debian:bookworm-slim", "docker.io/nvidia/cuda:12.8.1-runtime-ubuntu24.04"}
    assert stages()["final"].base == "base-cpu"  # the default


def test_the_image_and_the_manifests_agree() -> None:
    final = stages()["final"]
    env = final.env()
    uid, gid = (int(x) for x in final.all("USER")[0].split(":"))
    assert uid != 0
    (run,) = final.all("RUN")
    (useradd,) = [c for c in run_commands(run) if c[0] == "useradd"]
    assert useradd[useradd.index("--uid") + 1] == str(uid) and useradd[useradd.index("--gid") + 1] == str(gid)
    (volume,) = final.exec_form("VOLUME")
    assert env["GPUWORKER_STATE_DIR"] == volume
    (expose,) = final.all("EXPOSE")
    entry = final.exec_form("ENTRYPOINT")
    for variant in (K8S / "daemonset", K8S / "cpu"):
        resources = render(variant)
        pod = pod_spec(resources)
        c = container(pod, "gpuworkerd")
        sc = pod["securityContext"]
        assert (sc["runAsUser"], sc["runAsGroup"], sc["fsGroup"]) == (uid, gid, gid)
        table = mounts(pod, c)
        assert mount_of(volume, table) == volume  # the image's volume is the pod's state volume
        for key in ("GPUWORKER_STATE_DIR", "GPUWORKER_RUNTIME_DIR", "GPUWORKER_UNIX_SOCKET"):
            assert {e["name"]: e["value"] for e in c["env"]}[key] == env[key], key
        assert c["ports"][0]["containerPort"] == int(expose)
        assert config_arg(c) == final.exec_form("CMD")[1]
        tune = container(pod, "tune", init=True)
        assert Path(tune["command"][0]).parent == Path(entry[2]).parent  # gpuworkerctl beside gpuworkerd
        state_owner = [i for i in pod["initContainers"] if i["name"] == "state-owner"]
        assert all(i["command"][0] in ESSENTIAL and i["command"][1] == f"{uid}:{gid}" for i in state_owner)


@pytest.mark.slow
def test_the_build_steps_install_a_working_daemon_in_a_clean_directory(tmp_path: Path) -> None:
    """The build stage's COPY and RUN steps, here: the files it copies into an empty directory, then its RUN line
    (make clean && make image-deps) with the system's python3. The venv it leaves has the entry point and the
    tune command, runs from the copy (not from this checkout), and accepts the pod's configuration."""
    st = stages()
    work = tmp_path / "opt" / "trio-gpuworker"
    work.mkdir(parents=True)
    for copy in st[BUILD].all("COPY"):
        *sources, dest = copy.split()
        for src in sources:
            target = work / dest if dest.endswith("/") and len(sources) == 1 and (ROOT / src).is_dir() \
                else work / dest / Path(src).name
            (shutil.copytree if (ROOT / src).is_dir() else shutil.copy2)(ROOT / src, target)
    assert not (work / ".venv").exists()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(sys.prefix))
    (run,) = st[BUILD].all("RUN")[1:]
    build = subprocess.run(["bash", "-c", run], cwd=work, env=env, capture_output=True, text=True, timeout=1500,
                           check=False)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    venv_bin = work / ".venv" / "bin"
    assert (venv_bin / "gpuworkerd").is_file() and (venv_bin / "gpuworkerctl").is_file()
    where = subprocess.run([venv_bin / "python", "-c", "import cython_ring._ring as r, trio_gpuworker as t; "
                            "print(r.__file__); print(t.__file__)"], capture_output=True, text=True, timeout=60,
                           check=True, env=env, cwd=tmp_path)
    assert all(line.startswith(str(work)) for line in where.stdout.split())
    assert list((work / "trio_gpuworker").glob("__pycache__/*.pyc"))  # compiled for a read-only filesystem
    resources = render(K8S / "cpu")
    pod = lay_out(resources, tmp_path / "pod")
    (workdir,) = st[FINAL].all("WORKDIR")
    parse_config(pod.config.read_text(), pod.fs(workdir), pod.env)  # here, as a check of the test's inputs
    check = subprocess.run([venv_bin / "gpuworkerd", "--check-config", "--config", pod.config], capture_output=True,
                           text=True, timeout=120, check=False, env={**env, **pod.env}, cwd=pod.fs(workdir))
    assert check.returncode == 0 and "configuration OK: 3 lane(s), 2 model(s)" in check.stdout, check.stderr
    again = subprocess.run(["make", "image-deps"], cwd=work, env=env, capture_output=True, text=True, timeout=600,
                           check=True)
    assert "pip" not in again.stdout  # the stamps are fresh: a second run installs nothing
