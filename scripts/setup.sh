#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install megatron-elaswave with its test tools.
# torch 2.13.0 is installed first and on its own, so that pip never swaps in another build.
#
# MEGATRON_CORE=0.19.2 sets up that megatron-core release instead of the newest the Python allows,
# in .venv-mcore<release>. megatron-core 0.17 and later need Python 3.12 or newer: PYTHON names
# the interpreter, else python3 if new enough, else python3.12 or python3.13 (pyenv's included).
#
# --torch-only creates the environment and installs torch alone (the long part: a download of
# several GB where the index has only the CUDA build); it may run beside another setup from the
# same tree, whereas two editable installs from one tree must not.
set -euo pipefail
cd "$(dirname "$0")/.."
megatron_core="${MEGATRON_CORE:-}"
venv="${ELASWAVE_VENV:-.venv${megatron_core:+-mcore$megatron_core}}"

# Print the command that runs a Python the megatron-core release can be installed on.
python_for_release() {
  if [ -n "${PYTHON:-}" ] || [ -z "$megatron_core" ]; then
    echo "${PYTHON:-python3}"
    return
  fi
  if python3 -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    echo python3
    return
  fi
  local minor version
  for minor in 3.12 3.13; do
    if "python$minor" --version >/dev/null 2>&1; then
      echo "python$minor"
      return
    fi
    version=$(pyenv versions --bare 2>/dev/null | grep -E "^${minor//./\\.}\.[0-9]+$" | tail -n 1 || true)
    if [ -n "$version" ]; then
      echo "env PYENV_VERSION=$version python$minor"
      return
    fi
  done
  echo "error: megatron-core $megatron_core needs Python 3.12 or newer; set PYTHON to one" >&2
  exit 2
}

# etcd for the job store on an etcd cluster (elaswave-run --store etcd://..., tests/test_etcd.py,
# which skip where it is missing): Debian's etcd-server, where apt is at hand and we may use it.
if ! command -v etcd >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ] && [ "${1:-}" != "--torch-only" ]; then
  (apt-get install -y -qq etcd-server >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq etcd-server >/dev/null 2>&1; }) \
    || echo "note: could not install etcd-server; the tests of the store on etcd will be skipped" >&2
fi

if [ ! -x "$venv/bin/python" ]; then
  python_cmd=$(python_for_release)
  $python_cmd -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
if [ "${1:-}" = "--torch-only" ]; then
  exit 0
fi
python -m pip install --quiet --disable-pip-version-check -e ".[test,logging]" \
  ${megatron_core:+"megatron-core==$megatron_core"}
# An editable install leaves the package's bytecode to its first import, which every worker
# of every job repeats where PYTHONDONTWRITEBYTECODE is set.
python -m compileall -q megatron_elaswave patches scripts tests >/dev/null
python -c "import megatron_elaswave.patches as p; p.check_torch(); p.check_megatron_core_version()"
