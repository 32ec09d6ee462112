# The two Quick-start commands. Each creates .venv on first use: the pinned CPU torch first (a looser
# requirement would pull a multi-GB CUDA build), then mini-infer with its test and bench extras.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: run test

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -c constraints.txt -e '.[test,bench]'
	touch $(STAMP)

# Main job: benchmark mini-infer against HF transformers on the default model (random-weight Qwen2.5-0.5B
# shape, written to ~/.cache/mini-infer on first use): table, JSON and PNG under bench-results/.
run: $(STAMP)
	$(VENV)/bin/mini-infer bench

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q
