"""docs/testing.md's examples, taken from the page itself: the retry test (under 30 lines) passes when pytest runs
it as a user would, outside this project's configuration, and the simulated-world scenario finds nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "testing.md"


def example(heading: str) -> str:
    section = DOC.read_text().split(f"## {heading}\n", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None, f"docs/testing.md lost the example under {heading!r}"
    return found.group(1)


def test_the_retry_example_runs_under_pytest(tmp_path: Path) -> None:
    code = example("A retry, tested against a crash mid-request")
    assert len(code.splitlines()) < 30
    (tmp_path / "test_retry.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_retry.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_the_scenario_example_finds_nothing() -> None:
    code = example("The simulated world")
    exec(compile(code, f"{DOC}:scenario", "exec"), {"__name__": "docs_testing_scenario"})  # its own assert
