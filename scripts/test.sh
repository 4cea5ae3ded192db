#!/usr/bin/env bash
# Set everything up, then run the test suite (extra arguments go to pytest): every test but
# those marked `sweep`, which repeat another test's check at more ranks, layouts or moments.
# --all runs those too; --quick runs the fast tier instead: every test that starts no
# processes, and the few multi-process tests marked `quick` (one failure of each kind the
# runtime survives).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=(-m "not sweep")
if [ "${1:-}" = "--quick" ]; then
  shift
  tier=(-m "not multiprocess or quick")
elif [ "${1:-}" = "--all" ]; then
  shift
  tier=()
fi
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${ELASWAVE_VENV:-.venv${MEGATRON_CORE:+-mcore$MEGATRON_CORE}}/bin/activate"
status=0
python -m pytest -q --durations=15 "${tier[@]}" "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
fi
exit "$status"
