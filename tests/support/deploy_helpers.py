"""What the deploy tests read from deploy/: the Containerfile's instructions, the rendered Kubernetes variants, the
pod's containers, mounts and environment, and the pod's filesystem laid out under a temporary directory."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support.kustomize_subset import render

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
CONTAINERFILE = DEPLOY / "Containerfile"
KUBERNETES_VERSION = "1.37"  # the schemas kubernetes-validate (requirements-test.txt) ships for it
# variant -> (the kustomization it builds on, components added to it)
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "gpu-daemonset": (".", ()),
    "cpu-daemonset": ("daemonset", ()),
    "cpu-deployment": ("cpu", ()),
    "gpu-daemonset+servicemonitor": (".", ("components/servicemonitor",)),
    "cpu-deployment+servicemonitor": ("cpu", ("components/servicemonitor",)),
    "base": ("base", ()),
}
WORKLOAD_VARIANTS = [v for v in VARIANTS if v != "base"]
Resource = dict[str, Any]


# --- the Containerfile -------------------------------------------------------------------------------------

@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [args for o, args in self.instructions if o == op]

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for args in self.all("ENV"):
            for word in shlex.split(args):
                k, _, v = word.partition("=")
                out[k] = v
        return out

    def exec_form(self, op: str) -> list[str]:
        (args,) = self.all(op)
        return json.loads(args)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comment lines dropped, as the builder reads
    them."""
    out, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        op, _, args = current.strip().partition(" ")
        out.append((op.upper(), " ".join(args.split())))
        current = ""
    return out


def stages(build_args: dict[str, str] | None = None, text: str | None = None) -> dict[str, Stage]:
    """The Containerfile's stages by name (the last one is also "final"), FROM lines resolved with the global
    ARG defaults and `build_args`."""
    args: dict[str, str] = {}
    out: dict[str, Stage] = {}
    stage: Stage | None = None
    for op, rest in instructions(text if text is not None else CONTAINERFILE.read_text()):
        if op == "ARG" and stage is None:
            k, _, v = rest.partition("=")
            args[k] = (build_args or {}).get(k, v)
        elif op == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else f"stage{len(out)}"
            stage = out[name] = Stage(base, name)
        else:
            assert stage is not None, f"{op} before FROM"
            stage.instructions.append((op, rest))
    assert stage is not None
    out["final"] = stage
    return out


def run_commands(script: str) -> list[list[str]]:
    """The simple commands of a RUN line (split at && || ; |), each without its leading VAR=value words."""
    commands = []
    for part in re.split(r"&&|\|\||;|\|", script):
        words = shlex.split(part)
        while words and re.fullmatch(r"\w+=\S*", words[0]):
            words.pop(0)
        if words:
            commands.append(words)
    return commands


# --- rendered variants ------------------------------------------------------------------------------------

def kubectl() -> str | None:
    return shutil.which("kubectl")


def render_variant(variant: str, workdir: Path) -> tuple[list[Resource], list[Resource] | None]:
    """(the Python renderer's resources, kubectl kustomize's or None without kubectl), rendered from a copy of
    deploy/k8s; a variant with components gets a kustomization of its own beside the copy."""
    tree = workdir / variant / "k8s"
    base, components = VARIANTS[variant]
    if not tree.exists():
        shutil.copytree(K8S, tree)
        if components:  # outside the tree: kustomize refuses a kustomization inside one it includes
            (tree.parent / "composed").mkdir()
            (tree.parent / "composed" / "kustomization.yaml").write_text(yaml.safe_dump(
                {"resources": [f"../k8s/{base}"], "components": [f"../k8s/{c}" for c in components]}))
    tree = tree.parent / "composed" if components else tree / base
    ours = render(tree)
    exe = kubectl()
    if exe is None:
        return ours, None
    out = subprocess.run([exe, "kustomize", str(tree)], capture_output=True, text=True, timeout=120, check=True)
    return ours, [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(resources: list[Resource]) -> dict[str, Resource]:
    out = {r["kind"]: r for r in resources}
    assert len(out) == len(resources), "one resource of each kind"
    return out


def workload(resources: list[Resource]) -> Resource:
    (w,) = [r for r in resources if r["kind"] in ("DaemonSet", "Deployment")]
    return w


# --- the pod -----------------------------------------------------------------------------------------------

def pod_spec(resources: list[Resource]) -> dict[str, Any]:
    return workload(resources)["spec"]["template"]["spec"]


def container(pod: dict[str, Any], name: str, init: bool = False) -> dict[str, Any]:
    (c,) = [c for c in pod["initContainers" if init else "containers"] if c["name"] == name]
    return c


def mounts(pod: dict[str, Any], c: dict[str, Any]) -> dict[str, tuple[dict[str, Any], bool]]:
    """mountPath -> (the volume, read-only?) for one container."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {m["mountPath"]: (volumes[m["name"]], bool(m.get("readOnly"))) for m in c["volumeMounts"]}


def mount_of(path: str | Path, table: dict[str, tuple[dict[str, Any], bool]]) -> str | None:
    """The mountPath that holds `path` in the pod (the deepest), or None when it is on the image's filesystem."""
    p = Path(path)
    found = [m for m in table if p == Path(m) or Path(m) in p.parents]
    return max(found, key=len) if found else None


def container_env(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", [])}


def port_number(c: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (n,) = [p["containerPort"] for p in c["ports"] if p["name"] == port]
    return n


def configmap_file(resources: list[Resource], pod: dict[str, Any], c: dict[str, Any], path: str) -> str:
    """The text of the file `path` as the container sees it, from the ConfigMap volume mounted there."""
    mount = mount_of(path, mounts(pod, c))
    assert mount is not None, f"{path} is on no volume"
    volume = mounts(pod, c)[mount][0]["configMap"]
    (cm,) = [r for r in resources if r["kind"] == "ConfigMap" and r["metadata"]["name"] == volume["name"]]
    rel = str(Path(path).relative_to(mount))
    key = next((i["key"] for i in volume.get("items", []) if i["path"] == rel), rel)
    return cm["data"][key]


class PodFs:
    """The pod's filesystem under `root`: a path on one of the container's volumes maps to root/<path>; the
    image's own paths stay as they are."""

    def __init__(self, root: Path, table: dict[str, tuple[dict[str, Any], bool]]) -> None:
        self.root = root
        self.table = table

    def __call__(self, path: str) -> Path:
        mount = mount_of(path, self.table)
        assert mount is not None, f"{path} is not on a volume of the pod"
        return self.root / path.lstrip("/")

    def rewrite(self, text: str) -> str:
        """A config file's quoted pod paths on the container's volumes moved under root, in one pass."""
        def move(m: re.Match[str]) -> str:
            return f'"{self(m.group(1))}"' if mount_of(m.group(1), self.table) else m.group(0)

        return re.sub(r'"(/[^"]*)"', move, text)


@dataclass
class Pod:
    """The daemon's container laid out on this machine: its volumes under `fs.root`, the files the ConfigMap and
    the Secret put there, the environment the image and the manifest give it (paths moved under the root unless
    the pod's paths are mounted where the manifest says: tests/support/pod_sandbox.py)."""

    pod: dict[str, Any]
    container: dict[str, Any]
    fs: PodFs
    env: dict[str, str]
    config: Path  # the --config file, where this machine sees it (under the root)
    api_key: str


def config_arg(c: dict[str, Any]) -> str:
    args = [*c.get("command", []), *c.get("args", [])]
    return args[args.index("--config") + 1]


def lay_out(resources: list[Resource], root: Path, uid: int | None = None, moved: bool = True) -> Pod:
    """Make the gpuworkerd container's volumes under `root`, owned by `uid` where given (as the kubelet does
    with runAsUser and fsGroup), with the ConfigMap's file and a fresh API key in the Secret's file. With
    `moved`, the paths in the configuration and the environment are moved under `root` too."""
    import secrets
    import tomllib

    pod = pod_spec(resources)
    c = container(pod, "gpuworkerd")
    table = mounts(pod, c)
    fs = PodFs(root, table)
    for path, (volume, _) in table.items():
        fs(path).mkdir(parents=True, exist_ok=True)
        writable = {"emptyDir", "hostPath", "persistentVolumeClaim"} & set(volume)
        if uid is not None and writable:  # state-owner chowns the hostPath, fsGroup the claim and the emptyDirs
            os.chown(fs(path), uid, pod["securityContext"]["fsGroup"])
    text = configmap_file(resources, pod, c, config_arg(c))
    config = fs(config_arg(c))
    config.write_text(fs.rewrite(text) if moved else text)
    key = secrets.token_urlsafe(32)
    keys_file = fs(tomllib.loads(text)["http"]["api_keys_file"])
    keys_file.write_text(f"# the Secret gpuworkerd-api-keys\n{key}\n")
    (secret,) = [v["secret"] for v, _ in table.values() if "secret" in v]
    os.chmod(keys_file, secret.get("defaultMode", 0o644))
    if uid is not None:
        os.chown(keys_file, 0, pod["securityContext"]["fsGroup"])
    image_env = {k: v for k, v in stages()["final"].env().items() if k != "PATH"}
    env = {k: str(fs(v)) if v.startswith("/") and moved else v for k, v in {**image_env, **container_env(c)}.items()}
    return Pod(pod, c, fs, env, config, key)
