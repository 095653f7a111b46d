# Two entry points for a fresh machine: `make build` and `make test`.
# Everything (venv, dependencies, ptxas from the nvidia-cuda-nvcc wheel) is set up from nothing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: build test test-slow bench clean setup test-deps-system

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[toolchain,test]'
	$(BIN)/ptxc --version
	touch $(STAMP)

build: $(STAMP)
	$(BIN)/ptxc build specs/ --out out/ -j $(JOBS)

test: $(STAMP)
	$(BIN)/python -m pytest -q

# System packages for optional tests: Debian's chromium renders the HTML report headless
# (tests/test_report.py screenshot). Installs only as root where apt-get exists, and never
# fails the build: without chromium that one test skips and says why.
test-deps-system:
	@if command -v chromium >/dev/null 2>&1; then echo "test-deps-system: chromium present"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  (DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	   DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || echo "test-deps-system: could not install chromium; the screenshot test will skip"; \
	else echo "test-deps-system: not root or no apt-get; chromium not installed (the screenshot test will skip)"; fi

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python bench/frontend.py

clean:
	rm -rf $(VENV) out/*/ out/manifest.json
