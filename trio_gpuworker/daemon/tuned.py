"""Which models' tuned kernels a state directory's caches hold: `<state_dir>/cache/tuned.json`, written by every
successful search (`gpuworkerctl tune`, the pod's init container, the daemon's background tuner) and read at
start, so a daemon whose models were tuned ahead of time loads the tuned kernels at once instead of tuning again.

The key is the artifact (path, size, mtime), the beam, the device, runtime_config and max_tokens: any of them
changed, the kernels are not the ones searched. If the kernel and JIT caches were wiped meanwhile, a worker's LOAD
searches again, as `gpuworkerctl tune` would: the record only skips the wait for the tuner.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .._config import ModelConfig, SupervisorConfig

RECORD_FILE = "tuned.json"


def tuner_device(sc: SupervisorConfig, model: str) -> str:
    """The device a model is tuned on: that of the first lane serving it."""
    return next((ln.device for ln in sc.lanes if model in ln.models), "CPU")


class TunedRecord:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "cache" / RECORD_FILE
        try:
            self._keys: dict[str, str] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self._keys = {}

    @staticmethod
    def key(mc: ModelConfig, device: str) -> str:
        st = mc.path.stat()
        return json.dumps([os.fspath(mc.path), st.st_size, st.st_mtime_ns, mc.beam, device,
                           mc.runtime_config.to_map(), mc.max_tokens])

    def has(self, mc: ModelConfig, device: str) -> bool:
        return self._keys.get(f"{mc.id}@{device}") == self.key(mc, device)

    def add(self, mc: ModelConfig, device: str) -> None:
        self._keys[f"{mc.id}@{device}"] = self.key(mc, device)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._keys, indent=1))
        tmp.replace(self.path)


__all__ = ["RECORD_FILE", "TunedRecord", "tuner_device"]
