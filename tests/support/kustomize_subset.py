"""The part of kustomize that deploy/k8s uses, in Python, for machines without kubectl.

    render(Path("deploy/k8s/cpu")) -> the resources `kubectl kustomize deploy/k8s/cpu` prints, as dicts

Supported, as kustomize v5 does them: `resources` (YAML files and directories of other kustomizations),
`components`, `configMapGenerator` with `files` (the name gets kustomize's content hash, and references from
pod templates follow it), `patches` with a `path` to a strategic-merge patch and no `target`, and `images`
with `newName`/`newTag`. Anything else in a kustomization is refused, so a manifest that grows past this
subset fails here instead of rendering differently; tests/test_deploy_manifests.py compares this renderer
with `kubectl kustomize` wherever kubectl is installed.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]
FIELDS = {"Kustomization": {"apiVersion", "kind", "resources", "components", "configMapGenerator", "patches",
                            "images"},
          "Component": {"apiVersion", "kind", "resources", "configMapGenerator", "patches", "images"}}
GENERATOR_FIELDS = {"name", "files"}
IMAGE_FIELDS = {"name", "newName", "newTag"}
# The patchMergeKey of each list field a strategic-merge patch of a pod template may touch; other lists
# are replaced whole (tolerations, args, items, capabilities, ...).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "volumeMounts": "mountPath",
              "env": "name", "ports": "containerPort", "imagePullSecrets": "name"}
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"}


class Unsupported(ValueError):
    """The kustomization uses something this subset does not implement."""


def render(root: Path) -> list[Resource]:
    generated: set[int] = set()  # ids of the ConfigMaps whose names get the content hash, at the very end
    resources = _build(root, "Kustomization", [], generated)
    renames: dict[str, str] = {}
    for res in resources:
        if id(res) in generated:
            old = res["metadata"]["name"]
            res["metadata"]["name"] = renames[old] = f"{old}-{configmap_hash(res)}"
    for res in resources:
        if res["kind"] in WORKLOADS:
            _rename_configmap_refs(res["spec"]["template"]["spec"], renames)
    return resources


def configmap_hash(cm: Resource) -> str:
    """kustomize's name suffix: sha256 of the Go JSON encoding of {data, kind, name}; kustomize v5 hashes the
    name as empty. The first 10 hex digits, with 0 1 3 a e mapped to g h k m t."""
    body = {"data": cm.get("data", {}), "kind": "ConfigMap", "name": ""}
    if cm.get("binaryData"):
        body["binaryData"] = cm["binaryData"]
    text = json.dumps(body, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                          ("\u2029", "\\u2029")):  # Go's json.Marshal escapes these
        text = text.replace(char, escaped)
    return hashlib.sha256(text.encode()).hexdigest()[:10].translate(str.maketrans("013ae", "ghkmt"))


def _load(directory: Path, kind: str) -> dict[str, Any]:
    path = directory / "kustomization.yaml"
    spec = yaml.safe_load(path.read_text())
    if spec.get("kind", "Kustomization") != kind:
        raise Unsupported(f"{path}: expected kind {kind}, found {spec.get('kind')}")
    extra = set(spec) - FIELDS[kind]
    if extra:
        raise Unsupported(f"{path}: {', '.join(sorted(extra))} not implemented by tests/support/kustomize_subset.py")
    return spec


def _build(directory: Path, kind: str, resources: list[Resource], generated: set[int]) -> list[Resource]:
    spec = _load(directory, kind)
    for entry in spec.get("resources", []):
        path = directory / entry
        if path.is_dir():
            resources += _build(path, "Kustomization", [], generated)
        else:
            resources += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for entry in spec.get("components", []):
        _build(directory / entry, "Component", resources, generated)
    for gen in spec.get("configMapGenerator", []):
        if set(gen) - GENERATOR_FIELDS:
            raise Unsupported(f"{directory}: configMapGenerator fields {sorted(set(gen) - GENERATOR_FIELDS)}")
        data = {}
        for item in gen["files"]:
            key, _, file = item.rpartition("=")
            data[key or Path(file).name] = (directory / file).read_text()
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data}
        resources.append(cm)
        generated.add(id(cm))
    for patch in spec.get("patches", []):
        if set(patch) != {"path"}:
            raise Unsupported(f"{directory}: only patches with a path (no target, no inline patch)")
        _apply_patch(resources, yaml.safe_load((directory / patch["path"]).read_text()), directory / patch["path"])
    for image in spec.get("images", []):
        if set(image) - IMAGE_FIELDS:
            raise Unsupported(f"{directory}: images fields {sorted(set(image) - IMAGE_FIELDS)}")
        for res in resources:
            if res["kind"] in WORKLOADS:
                _set_image(res["spec"]["template"]["spec"], image)
    return resources


def _apply_patch(resources: list[Resource], patch: Resource, where: Path) -> None:
    key = (patch["apiVersion"], patch["kind"], patch["metadata"]["name"])
    matches = [r for r in resources if (r["apiVersion"], r["kind"], r["metadata"]["name"]) == key]
    if len(matches) != 1:
        raise Unsupported(f"{where}: the patch's target {key} matches {len(matches)} resources")
    body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
    body["metadata"] = {k: v for k, v in patch["metadata"].items() if k != "name"}
    merged = merge(matches[0], body)
    matches[0].clear()
    matches[0].update(merged)


def merge(original: Any, patch: Any, field: str = "") -> Any:
    """A strategic merge: maps merge key by key (null deletes), lists with a merge key merge element by element
    (the patch's elements first, in its order, then the original's others, as kustomize orders them), other
    lists and scalars are replaced."""
    if isinstance(original, dict) and isinstance(patch, dict):
        out = dict(original)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = merge(original[k], v, k) if k in original else copy.deepcopy(v)
        return out
    key = MERGE_KEYS.get(field)
    if key and isinstance(original, list) and isinstance(patch, list):
        by_key = {item[key]: item for item in original}
        merged = [merge(by_key[item[key]], item) if item[key] in by_key else copy.deepcopy(item) for item in patch]
        patched = {item[key] for item in patch}
        return merged + [item for item in original if item[key] not in patched]
    return copy.deepcopy(patch)


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod.get("containers", [])]


def _set_image(pod: dict[str, Any], image: dict[str, str]) -> None:
    for c in _containers(pod):
        name, tag = _split_image(c["image"])
        if name == image["name"]:
            c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}" if image.get("newTag", tag) \
                else image.get("newName", name)


def _split_image(ref: str) -> tuple[str, str]:
    if "@" in ref:
        raise Unsupported(f"image {ref!r}: digests are not implemented")
    name, sep, tag = ref.rpartition(":")
    if not sep or "/" in tag:  # no tag (a colon there belongs to a registry's port)
        return ref, ""
    return name, tag


def _rename_configmap_refs(pod: dict[str, Any], renames: dict[str, str]) -> None:
    refs = [v["configMap"] for v in pod.get("volumes", []) if "configMap" in v]
    refs += [s["configMap"] for v in pod.get("volumes", []) for s in v.get("projected", {}).get("sources", [])
             if "configMap" in s]
    for c in _containers(pod):
        refs += [e["configMapRef"] for e in c.get("envFrom", []) if "configMapRef" in e]
        refs += [e["valueFrom"]["configMapKeyRef"] for e in c.get("env", [])
                 if "configMapKeyRef" in e.get("valueFrom", {})]
    for ref in refs:
        ref["name"] = renames.get(ref["name"], ref["name"])
