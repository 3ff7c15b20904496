"""worker/_devicecache.py: the CPU device's helper programs, lowered by the first worker and restored by later ones.

Each case opens the device in a fresh process (the patch is only meaningful before tinygrad's CPU device exists)
and then runs real kernels on it, so a wrong restored program would show as a wrong result or a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from trio_gpuworker.worker._devicecache import FILE

CHILD = """
import json, sys
from pathlib import Path
import numpy as np
from trio_gpuworker.worker._devicecache import open_device
restored, lowered = open_device(Path(sys.argv[1]))
from tinygrad import Tensor
a = np.arange(4096, dtype=np.float32)
got = ((Tensor(a) * 3 + 1).sum()).numpy().item()
t = Tensor(a).realize()
t.assign(t * 2).realize()  # a second kernel and a write, after the device's helpers ran once
print(json.dumps({"restored": restored, "lowered": lowered, "sum": got, "after": t.numpy()[:3].tolist()}))
"""


def _open(cache: Path) -> dict[str, object]:
    env = {**os.environ, "DEV": "CPU", "CACHEDB": str(cache / "tinygrad.db")}  # nothing outside tmp_path
    r = subprocess.run([sys.executable, "-c", CHILD, str(cache)], capture_output=True, text=True, env=env,
                       timeout=120, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _expected() -> tuple[float, list[float]]:
    import numpy as np

    a = np.arange(4096, dtype=np.float64)
    return float((a * 3 + 1).sum()), [0.0, 2.0, 4.0]


def test_the_first_process_lowers_and_stores_later_ones_restore(tmp_path: Path) -> None:
    total, after = _expected()
    first = _open(tmp_path)
    assert first["lowered"] == 4 and first["restored"] == 0  # signal, wait, timestamp, the worker loop
    assert (tmp_path / FILE).is_file()
    second = _open(tmp_path)
    assert second["restored"] == 4 and second["lowered"] == 0
    for got in (first, second):
        assert got["sum"] == total and got["after"] == after


def test_an_altered_file_is_lowered_again_and_rewritten(tmp_path: Path) -> None:
    total, _ = _expected()
    _open(tmp_path)
    path = tmp_path / FILE
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # inside the pickle: its sha256 no longer matches
    path.write_bytes(bytes(data))
    again = _open(tmp_path)
    assert again["lowered"] == 4 and again["restored"] == 0 and again["sum"] == total
    assert _open(tmp_path)["restored"] == 4  # rewritten whole


def test_a_file_of_another_host_or_tinygrad_is_not_used(tmp_path: Path) -> None:
    import hashlib
    import pickle

    _open(tmp_path)
    path = tmp_path / FILE
    stored = pickle.loads(path.read_bytes().partition(b"\n")[2])
    stored["host_key"] = "tinygrad 0.0.0 x86_64:another"
    body = pickle.dumps(stored)
    path.write_bytes(hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
    assert _open(tmp_path)["lowered"] == 4
