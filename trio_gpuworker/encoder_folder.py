"""What a sentence-transformers folder says about its embeddings (docs/models.md, "Encoders"): `modules.json` lists
the modules after the transformer, the Pooling module's `config.json` (`1_Pooling/config.json`) says how the token
states become one vector, and a Normalize module makes it unit length.

Pure Python, no tinygrad: the daemon reads it for a model's default pooling and normalisation, the worker at LOAD,
where a folder it cannot serve as its author meant it is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._proto import POOLINGS

DEFAULT_POOLING, DEFAULT_NORMALIZE = "mean", True  # a folder without modules.json: what the daemon always did
# sentence-transformers' Pooling config before `pooling_mode`: one flag per mode, in its concatenation order
_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
_MODULES = ("Transformer", "Pooling", "Normalize")  # the modules served, by class name


@dataclass(frozen=True)
class FolderPooling:
    """The folder's pooling and normalisation; None where it says nothing (no modules.json, or no Pooling module)."""

    pooling: str | None
    normalize: bool | None


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc


def pooling_mode(config: Any, where: Path) -> str:
    """The one pooling a Pooling module's config names (`pooling_mode`, or the older `pooling_mode_*` flags, mean
    when none is set, as sentence-transformers reads them); ValueError naming a mode this daemon does not serve."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a JSON object")
    mode = config.get("pooling_mode")
    if mode is None:
        mode = [m for k, m in _LEGACY_MODES.items() if config.get(k) is True] or ["mean"]
    modes = [mode] if isinstance(mode, str) else mode
    if not isinstance(modes, list) or not modes or not all(isinstance(m, str) for m in modes):
        raise ValueError(f"{where}: pooling_mode must be a mode or a list of modes, got {mode!r}")
    if len(modes) > 1:
        raise ValueError(f"{where}: pooling {' + '.join(modes)} concatenates {len(modes)} poolings; one of "
                         f"{', '.join(POOLINGS)} is served")
    if modes[0] not in POOLINGS:
        raise ValueError(f"{where}: unsupported pooling {modes[0]!r} (served: {', '.join(POOLINGS)})")
    return modes[0]


def _module_kind(entry: Any, where: Path) -> str:
    if not isinstance(entry, dict) or not isinstance(entry.get("type"), str) or not isinstance(entry.get("path"), str):
        raise ValueError(f"{where}: every module needs a string type and path, got {entry!r}")
    kind = entry["type"].rsplit(".", 1)[-1]
    if kind not in _MODULES:
        raise ValueError(f"{where}: unsupported module {entry['type']!r} (served: {', '.join(_MODULES)})")
    return kind


def read(artifact: Path) -> FolderPooling:
    """The pooling and normalisation of the folder holding `artifact`; ValueError naming what it cannot serve: a
    module other than Transformer, Pooling and Normalize (a Dense projection, say), a pooling mode outside
    POOLINGS, or several concatenated."""
    where = artifact.parent / "modules.json"
    if not where.is_file():
        return FolderPooling(None, None)
    modules = _json(where)
    if not isinstance(modules, list):
        raise ValueError(f"{where}: expected a list of modules")
    kinds = [_module_kind(m, where) for m in modules]
    if kinds.count("Pooling") > 1:
        raise ValueError(f"{where}: {kinds.count('Pooling')} Pooling modules; one is served")
    pooling = None
    for entry, kind in zip(modules, kinds, strict=True):
        if kind == "Pooling":
            config = artifact.parent / entry["path"] / "config.json"
            pooling = pooling_mode(_json(config), config)
    return FolderPooling(pooling, "Normalize" in kinds)


def defaults(artifact: Path | None, pooling: str | None, normalize: bool | None) -> tuple[str, bool]:
    """A model's pooling and normalisation: the configuration's where it sets them, else the folder of `artifact`
    (None: no folder to read), else mean and unit length. A folder that cannot be served counts as silent here:
    the worker refuses it at LOAD."""
    folder = FolderPooling(None, None)
    if artifact is not None and (pooling is None or normalize is None):
        try:
            folder = read(Path(artifact))
        except ValueError:
            pass
    return (next(p for p in (pooling, folder.pooling, DEFAULT_POOLING) if p is not None),
            next(n for n in (normalize, folder.normalize, DEFAULT_NORMALIZE) if n is not None))
