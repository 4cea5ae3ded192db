# Shortcuts; each target sets everything up first (scripts/setup.sh).
VENV ?= $(or $(ELASWAVE_VENV),.venv)
PYTHON = $(VENV)/bin/python

.PHONY: setup demo test reproduce reproduce-smoke

setup:
	bash scripts/setup.sh

demo:
	bash scripts/demo.sh

test:
	bash scripts/test.sh

# The paper's evaluation on this machine: docs/results.md and docs/results/*.png.
reproduce: setup
	OMP_NUM_THREADS=1 $(PYTHON) scripts/reproduce.py

# Every experiment at toy size (a few minutes), report under runs/reproduce-smoke/.
reproduce-smoke: setup
	OMP_NUM_THREADS=1 $(PYTHON) scripts/reproduce.py --smoke
