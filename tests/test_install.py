"""The package as `make run` installs it, in a fresh virtual environment: the pinned dependencies of requirements.txt
alone (no test requirements, nothing of this environment's site-packages), then `pip install .`. In it, the installed
commands run (`gpuworkerd --help`, `gpuworkerctl --help`, and a `gpuworkerctl` call against a daemon), and a
script outside the checkout uses the installed package: trio_gpuworker.testing's fake engine process with a crash
plan and docs/engines.md's example engine, each a lane of a Supervisor.

The dependencies come from the machine's package sources (its mirror and wheel cache) as `make run`'s own `pip
install -r requirements.txt` gets them; this environment's pip installs them into the venv (`pip --python`), so the
venv needs no pip of its own. pip builds the package without isolation and without dependencies. The native
helper's binaries are the checkout's own, the ones every other test runs, placed where setuptools' build finds them
up to date; compiling them afresh is `make`'s part, not this test's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from tokenizers import Tokenizer

from tests.support.config import MODEL, daemon_config
from tests.support.engine_example import example
from tests.support.fakes import fake_command
from tests.support.helpers import TOKENIZER
from trio_gpuworker.daemon.main import run_daemon

ROOT = Path(__file__).resolve().parent.parent
LEFT_OUT = (".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis",
            ".state", ".run", ".whl", ".gl")

SCRIPT = textwrap.dedent('''
    """Outside the checkout: a fake lane with a crash plan and an example engine under one Supervisor."""
    import json
    import shutil
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
    RUN = Path(tempfile.mkdtemp(prefix="gw-"))  # the runtime directory, short: a socket's path must fit in 108 bytes
    ROWS = [np.array([1, 2, 3], np.int32)]


    async def main() -> None:
        (HERE / "bow.json").write_text(json.dumps({"dims": 8}))
        (HERE / "fake.bin").write_bytes(b"weights")
        crash = FaultPlan(faults={1: "crash_mid_request"}, once_file=HERE / "crashed")  # its first worker only
        config = SupervisorConfig(
            lanes=(LaneConfig("fake", (FAKE_MODEL,), worker_command=crash.command()),
                   LaneConfig("bow", ("bow",), worker_command=(sys.executable, str(HERE / "bow_engine.py")))),
            models=(ModelConfig(FAKE_MODEL, HERE / "fake.bin"), ModelConfig("bow", HERE / "bow.json")),
            state_dir=HERE / "state", runtime_dir=RUN,
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


    try:
        trio.run(main)
    finally:
        shutil.rmtree(RUN, ignore_errors=True)
''')


def copy_checkout(dst: Path) -> None:
    """The checkout, with the native helper's generated C and binaries up to date for setuptools' build: newer
    than their sources and than the Cython a fresh venv just installed (whose includes they depend on)."""
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(*LEFT_OUT))
    for generated in (dst / "cython_ring").glob("*.c"):
        generated.touch()
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


@pytest.fixture(scope="module")
def installed() -> Iterator[Path]:
    """A venv with requirements.txt's pins and the package installed (short path: the lanes' sockets live under
    it). Yields its directory's parent."""
    with tempfile.TemporaryDirectory(prefix="gw-install-") as d:
        base = Path(d)
        run([sys.executable, "-m", "venv", "--without-pip", str(base / "venv")], base, 60)
        pip = [sys.executable, "-m", "pip", "--python", str(base / "venv" / "bin" / "python"), "install", "-q",
               "--disable-pip-version-check"]
        run([*pip, "-r", str(ROOT / "requirements.txt")], base, 600)
        copy_checkout(base / "src")  # after the dependencies: see copy_checkout
        run([*pip, "--no-deps", "--no-build-isolation", str(base / "src")], base, 300)
        yield base


def test_an_installed_package_serves_a_fake_and_an_engine_from_outside_the_checkout(installed: Path) -> None:
    python = str(installed / "venv" / "bin" / "python")
    outside = installed / "outside"
    outside.mkdir()
    (outside / "bow_engine.py").write_text(example())
    (outside / "use.py").write_text(SCRIPT)
    out = run([python, "use.py"], outside, 120)
    assert f"from {installed / 'venv'}" in out, out


async def test_the_installed_commands_run_on_the_runtime_requirements(installed: Path, tmp_path: Path) -> None:
    """`gpuworkerctl` imports httpx: a runtime requirement, which only the test requirements once brought."""
    bin_dir = installed / "venv" / "bin"
    for command in ("gpuworkerd", "gpuworkerctl"):
        assert run([str(bin_dir / command), "--help"], installed, 60).startswith(f"usage: {command}")
    ctl = [str(bin_dir / "gpuworkerctl"), "--socket", str(tmp_path / "api.sock"), "--json"]
    async with trio.open_nursery() as nursery:
        await nursery.start(run_daemon, daemon_config(tmp_path, fake_command(), unix=True))
        out = await trio.to_thread.run_sync(lambda: run([*ctl, "embed", "-m", MODEL, "hello world"], installed, 60))
        nursery.cancel_scope.cancel()
    tok = Tokenizer.from_file(str(TOKENIZER))
    tok.no_padding()
    want = tok.encode("hello world").ids  # the fake's vector: [sum(ids), n_tokens, ...] of what the daemon sent
    assert [v[:2] for v in (d["embedding"] for d in json.loads(out)["data"])] == [[sum(want), len(want)]]
