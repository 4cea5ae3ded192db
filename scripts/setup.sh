#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install megatron-elaswave with its test tools.
# torch 2.13.0 is installed first and on its own, so that pip never swaps in another build.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${ELASWAVE_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e ".[test]"
python -c "import megatron_elaswave.patches as p; p.check_torch(); p.check_megatron_core_version()"
