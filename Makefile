# Two entry points for a fresh machine: `make build` and `make test`.
# Everything (venv, dependencies, ptxas from the nvidia-cuda-nvcc wheel) is set up from nothing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Two stamps: `make build` installs only what building needs (ptxc + ptxas, the `toolchain`
# extra); `make test` adds the test extras (pytest, nvdisasm, Triton ~1 GB, CCCL headers).
BUILD_STAMP := $(VENV)/.installed-build
TEST_STAMP  := $(VENV)/.installed-test
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)
# pytest-xdist workers for `make test`: two keep the default run near 13 min on 2 cores (it
# took ~20 serially); each worker runs whole tests, so more workers than cores only adds memory.
# Whole files go to one worker (--dist loadfile): a module's fixture (a build, the calibration's
# SASS, the spill sweep's lowering) is then made once, not once per worker that ran one of its
# tests (1755 tests: 13 min 25 s against 14.5-15.5 min dealt out one by one). In collection
# order (--no-loadscope-reorder), which tests/conftest.py's LONGEST_FIRST starts with the
# longest files, so the workers end together.
TEST_WORKERS ?= 2
TEST_DIST    ?= --dist loadfile --no-loadscope-reorder

.PHONY: build test test-slow bench clean setup test-deps-system

setup: $(BUILD_STAMP)

$(BUILD_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[toolchain]'
	$(BIN)/ptxc --version
	touch $(BUILD_STAMP)

$(TEST_STAMP): $(BUILD_STAMP)
	$(BIN)/python -m pip install --quiet -e '.[toolchain,test]'
	touch $(TEST_STAMP)

build: $(BUILD_STAMP)
	$(BIN)/ptxc build specs/ --out out/ -j $(JOBS)

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(TEST_DIST)

# System packages for optional tests: Debian's chromium renders the HTML report headless
# (tests/report/test_report.py screenshot). Installs only as root where apt-get exists, and never
# fails the build: without chromium that one test skips and says why.
test-deps-system:
	@if command -v chromium >/dev/null 2>&1; then echo "test-deps-system: chromium present"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  (DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	   DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || echo "test-deps-system: could not install chromium; the screenshot test will skip"; \
	else echo "test-deps-system: not root or no apt-get; chromium not installed (the screenshot test will skip)"; fi

test-slow: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -m slow -n $(TEST_WORKERS) $(TEST_DIST)

bench: $(TEST_STAMP)
	$(BIN)/python bench/frontend.py

clean:
	rm -rf $(VENV) out/*/ out/manifest.json
