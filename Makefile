# Two commands: `make run` (whole pipeline on the embedded models) and `make test`.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-10)
PROFILE ?= quick

export DO_NOT_TRACK := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export DVC_NO_ANALYTICS := 1
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: run ablations test ui-test venv data clean-cache

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[pipeline,dev]'
	rm -f $(VENV)/.installed-* && touch $@

data: venv
	dvc repro fetch

run: venv data
ifeq ($(PROFILE),quick)
	dvc repro report deploy
else
	dvc exp run -S profile=$(PROFILE) report deploy
endif

ablations: venv data
ifeq ($(PROFILE),quick)
	dvc repro ablation_report shift
else
	dvc exp run -S profile=$(PROFILE) ablation_report shift
endif

test: venv
	$(PY) -m pytest

ui-test: venv  # the UI servers on other ports + a headless-Chromium walkthrough (docs/operations.md; ~5 min)
	$(PY) -m pytest -m ui

clean-cache:
	rm -rf .prefect/results
