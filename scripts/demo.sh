#!/usr/bin/env bash
# Set everything up, then run the demo: GPT training on 8 CPU ranks (TP2 x PP2 x DP2) on real text.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${ELASWAVE_VENV:-.venv${MEGATRON_CORE:+-mcore$MEGATRON_CORE}}/bin/activate"
exec python scripts/demo.py "$@"
