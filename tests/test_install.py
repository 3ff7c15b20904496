"""`pip install .` into a fresh virtual environment, then a script outside the checkout uses the installed package:
trio_gpuworker.testing's fake engine process with a crash plan and docs/engines.md's example engine, each a lane of
a Supervisor.

No network: the venv sees this environment's site-packages (the dependencies, pip, setuptools, Cython) through a
.pth path entry, and pip builds without isolation and without dependencies. The native helper's binaries are the
checkout's own, the ones every other test runs, placed where setuptools' build finds them up to date; compiling
them afresh is `make`'s part, not this test's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path

from tests.test_engine_example import example

ROOT = Path(__file__).resolve().parent.parent
LEFT_OUT = (".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis",
            ".state", ".run", ".whl", ".gl")

SCRIPT = textwrap.dedent('''
    """Outside the checkout: a fake lane with a crash plan and an example engine under one Supervisor."""
    import json
    import sys
    import tempfile
    from pathlib import Path

    import numpy as np
    import trio

    import trio_gpuworker
    import trio_gpuworker.engine
    from trio_gpuworker import EngineCrashed, LaneConfig, ModelConfig, Supervisor, SupervisorConfig, Windows
    from trio_gpuworker.testing import FAKE_MODEL, FaultPlan

    HERE = Path.cwd()
    ROWS = [np.array([1, 2, 3], np.int32)]


    async def main() -> None:
        (HERE / "bow.json").write_text(json.dumps({"dims": 8}))
        (HERE / "fake.bin").write_bytes(b"weights")
        crash = FaultPlan(faults={1: "crash_mid_request"}, once_file=HERE / "crashed")  # its first worker only
        config = SupervisorConfig(
            lanes=(LaneConfig("fake", (FAKE_MODEL,), worker_command=crash.command()),
                   LaneConfig("bow", ("bow",), worker_command=(sys.executable, str(HERE / "bow_engine.py")))),
            models=(ModelConfig(FAKE_MODEL, HERE / "fake.bin"), ModelConfig("bow", HERE / "bow.json")),
            state_dir=HERE / "state", runtime_dir=Path(tempfile.mkdtemp(prefix="gw-")),
            windows=Windows(inference_s=5, setup_s=10, control_s=10, load_s=10, kill_grace_s=1, shutdown_s=2))
        async with Supervisor(config) as sup:
            first = sup.lanes["fake"].generation
            try:
                await sup.embed_ids(ROWS, model=FAKE_MODEL, pooling="mean", normalize=False)
                raise AssertionError("the plan's crash did not happen")
            except EngineCrashed as exc:
                assert exc.exit_code == 5, exc
            out = await sup.embed_ids(ROWS, model=FAKE_MODEL, pooling="mean", normalize=False)
            assert out[0, :2].tolist() == [6, 3] and sup.lanes["fake"].generation > first
            bow = await sup.embed_ids(ROWS, model="bow", pooling="mean", normalize=True)
            assert bow.shape == (1, 8) and abs(float(np.linalg.norm(bow[0])) - 1) < 1e-6
        print("used", trio_gpuworker.__version__, "from", Path(trio_gpuworker.engine.__file__).parent.parent)


    trio.run(main)
''')


def copy_checkout(dst: Path) -> None:
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(*LEFT_OUT))
    plat = f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
    built = dst / "build" / plat / "cython_ring"
    built.mkdir(parents=True)
    for binary in (ROOT / "cython_ring").glob("*.so"):
        shutil.copyfile(binary, built / binary.name)  # a fresh mtime: newer than its sources, so not rebuilt


def run(argv: list[str], cwd: Path, timeout: float) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    done = subprocess.run(argv, cwd=cwd, env={**env, "PYTHONNOUSERSITE": "1"}, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{argv[:4]}...\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_an_installed_package_serves_a_fake_and_an_engine_from_outside_the_checkout() -> None:
    with tempfile.TemporaryDirectory(prefix="gw-install-") as d:  # short: the lanes' sockets live under it
        base = Path(d)
        copy_checkout(base / "src")
        run([sys.executable, "-m", "venv", "--without-pip", str(base / "venv")], base, 60)
        python = str(base / "venv" / "bin" / "python")
        purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], base, 30)
        (Path(purelib.strip()) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--ignore-installed", "-q",
             "--disable-pip-version-check", str(base / "src")], base, 300)
        outside = base / "outside"
        outside.mkdir()
        (outside / "bow_engine.py").write_text(example())
        (outside / "use.py").write_text(SCRIPT)
        out = run([python, "use.py"], outside, 120)
        assert f"from {base / 'venv'}" in out, out
