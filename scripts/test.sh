#!/usr/bin/env bash
# Set everything up, then run the whole test suite (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${ELASWAVE_VENV:-.venv${MEGATRON_CORE:+-mcore$MEGATRON_CORE}}/bin/activate"
status=0
python -m pytest -q --durations=15 "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
fi
exit "$status"
