import os
import shutil

from tests.support.state import SESSION_CACHE, SESSION_STATE, SHORT_DIRS

# the fixtures trio_gpuworker.testing gives its users (a supervisor with fake lanes, the simulation's clock)
pytest_plugins = ["trio_gpuworker.testing.pytest_plugin"]

# Workers and in-process model tests run tinygrad on the CPU here; set before anything imports it.
os.environ.setdefault("DEV", "CPU")
# Reference models (sentence-transformers, transformers) load from installed packages only; huggingface_hub
# reads this once at import, so it is set before any test module imports them.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# In-process tinygrad shares the session's kernel cache with the workers of tests that use SESSION_STATE.
os.environ.setdefault("CACHEDB", str(SESSION_CACHE / "tinygrad.db"))


def pytest_sessionfinish(session: object, exitstatus: int) -> None:
    for path in (SESSION_STATE, *SHORT_DIRS):
        shutil.rmtree(path, ignore_errors=True)
