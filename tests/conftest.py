import os
import pathlib

# Workers and in-process model tests run tinygrad on the CPU here; set before anything imports it.
os.environ.setdefault("DEV", "CPU")
# Reference models (sentence-transformers, transformers) load from installed packages only; huggingface_hub
# reads this once at import, so it is set before any test module imports them.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
_cache = pathlib.Path(__file__).resolve().parent.parent / ".state" / "cache"
_cache.mkdir(parents=True, exist_ok=True)
os.environ.setdefault("CACHEDB", str(_cache / "tinygrad.db"))
