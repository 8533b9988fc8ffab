# The README's two commands: `make run` and `make test`. Both set up .venv first (and skip the
# install when the dependency files have not changed since the last one).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
CONFIG ?= config/config.yaml
CORES ?= all
# The torch releases this project's build machines carry locally; see README "Installing".
TORCH_PINS := torch==2.14.1 torchvision==0.29.1

.PHONY: setup run test clean help

help:
	@echo "make run    set up and run the whole pipeline on $(CONFIG), ending in results/report/index.html"
	@echo "make test   set up and run ruff and the test suite"
	@echo "make setup  only create/refresh $(VENV)"

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]' $(TORCH_PINS)
	@touch $(STAMP)

setup: $(STAMP)

# The rules call `detscale` and `torchrun`: the venv's bin goes first on PATH.
export PATH := $(abspath $(BIN)):$(PATH)

run: $(STAMP)
	snakemake --cores $(CORES) --configfile $(CONFIG) --rerun-incomplete --printshellcmds
	@echo "report: results/report/index.html"

test: $(STAMP)
	ruff check src tests benchmarks
	python -m pytest tests

clean:
	rm -rf results logs benchmarks/out .snakemake
