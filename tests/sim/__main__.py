"""python -m tests.sim: run, replay and shrink simulation schedules.

    python -m tests.sim run --seeds 0:100000 [--jobs 2] [--steps 14]   every seed; prints the count, wall time
                                                                       and each failing seed with its finding
    python -m tests.sim replay SEED [--shrink] [--steps 14]           one seed: its schedule and findings; with
                                                                       --shrink, the shortest schedule found that
                                                                       still fails
    python -m tests.sim mutate NAME --seeds 0:2000                      which seeds catch a known defect put back
                                                                       (tests/sim/mutations.py)

A seed fixes the whole run (schedule, worker fates, trio's scheduling) on one machine and Python; runs are
compared with PYTHONHASHSEED=0, as `make sim` sets it.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tests.sim.mutations import NAMES, mutated
from trio_gpuworker.testing import make_schedule, run_schedule, search_schedules, shrink


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.sim", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--seeds", default="0:100000")
    r.add_argument("--jobs", type=int, default=2)
    r.add_argument("--steps", type=int, default=14)
    m = sub.add_parser("mutate")
    m.add_argument("name", choices=NAMES)
    m.add_argument("--seeds", default="0:2000")
    m.add_argument("--jobs", type=int, default=2)
    m.add_argument("--steps", type=int, default=14)
    rp = sub.add_parser("replay")
    rp.add_argument("seed", type=int)
    rp.add_argument("--steps", type=int, default=14)
    rp.add_argument("--shrink", action="store_true")
    rp.add_argument("--mutation", choices=NAMES)
    args = p.parse_args(argv)
    if args.cmd == "replay":
        base = Path(tempfile.mkdtemp(prefix="gpuworker-sim-"))
        try:
            with mutated(args.mutation):
                schedule = make_schedule(args.seed, args.steps)
                found = run_schedule(schedule, base)
                print(schedule.describe())
                print("\n".join(found) or "no findings")
                if found and args.shrink:
                    small = shrink(schedule, base)
                    print(f"\nshrunk to {len(small.steps)} step(s):\n{small.describe()}")
                    print("\n".join(run_schedule(small, base)))
        finally:
            shutil.rmtree(base, ignore_errors=True)
        return 1 if found else 0
    first, last = (int(x) for x in args.seeds.split(":"))
    t0 = time.monotonic()
    setup = functools.partial(mutated, args.name) if args.cmd == "mutate" else None
    failing = search_schedules(range(first, last), max_steps=args.steps, jobs=args.jobs, setup=setup)
    wall = time.monotonic() - t0
    what = f" with mutation {args.name}" if args.cmd == "mutate" else ""
    print(f"{last - first} schedules (seeds {first}..{last - 1}, up to {args.steps} steps each){what} in "
          f"{wall:.0f} s on {args.jobs} process(es): {len(failing)} with invariant violations")
    for seed, finding in failing[:20]:
        print(f"  seed {seed}: {finding.splitlines()[0][:200]}\n    replay: python -m tests.sim replay {seed} --shrink")
    return 1 if failing and args.cmd == "run" else 0


if __name__ == "__main__":
    sys.exit(main())
