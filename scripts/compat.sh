#!/usr/bin/env bash
# The newest end of the supported range: a Python 3.12 virtual environment with the newest
# jax / flax / optax / orbax-checkpoint that pip finds within pyproject.toml's ranges (nothing
# pinned here), the project installed into it, and the test suite run there. The oldest end,
# jax 0.10 on Python 3.11, is what .ci/run tests: it pins nothing either, but jax 0.11 and
# later require Python >= 3.12, so pip on Python 3.11 resolves jax 0.10.
#
#   scripts/compat.sh                 # venv in .venv-compat, then pytest (all tests)
#   scripts/compat.sh tests/test_step.py -x   # arguments go to pytest
#
# Environment: PYTHON312 (default: the newest $(pyenv root)/versions/3.12*/bin/python, else
# python3.12 on PATH), COMPAT_VENV (default .venv-compat). Prints the versions it tested and
# the wall time of each phase.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON312:-}"
if [[ -z "$py" ]] && command -v pyenv >/dev/null; then
    py="$(ls -d "$(pyenv root)"/versions/3.12*/bin/python 2>/dev/null | sort -V | tail -1 || true)"
fi
py="${py:-$(command -v python3.12 || true)}"
if [[ -z "$py" ]]; then
    echo "compat.sh: no Python 3.12 found; set PYTHON312=/path/to/python3.12" >&2
    exit 2
fi
venv="${COMPAT_VENV:-.venv-compat}"
t0=$SECONDS
rm -rf "$venv"
"$py" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet --upgrade -e ".[test]" jax flax optax orbax-checkpoint
echo "compat.sh: installed in $((SECONDS - t0)) s:" \
    "$("$venv/bin/python" -c 'import sys, jax, flax, optax, orbax.checkpoint as o; print(f"python {sys.version.split()[0]} jax {jax.__version__} flax {flax.__version__} optax {optax.__version__} orbax-checkpoint {o.__version__}")')"
t1=$SECONDS
status=0
"$venv/bin/python" -m pytest "$@" || status=$?
echo "compat.sh: tests finished in $((SECONDS - t1)) s with status $status"
exit $status
