# Two entry points for a fresh machine: `make build` and `make test`.
# Everything (venv, dependencies, ptxas from the nvidia-cuda-nvcc wheel) is set up from nothing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: build test test-slow bench clean setup

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

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python bench/frontend.py

clean:
	rm -rf $(VENV) out/*/ out/manifest.json
