#!/usr/bin/env bash
# The test suite under another torch (and Python): builds a venv with that
# torch, a numpy it supports and a copy of this working tree, then runs the
# README's test command in the copy.
#
#   tools/compat.sh TORCH [PYTHON] [-- PYTEST ARGS]
#   tools/compat.sh 2.6.0 3.11          # the whole suite, torch 2.6.0, Python 3.11
#   tools/compat.sh 2.13.0 3.11 -- -m "not slow"
#
# TORCH other than 2.13.0 is a CUDA build of several GB from PyPI (it runs on
# the CPU).  NUMPY overrides the numpy requirement; COMPAT_DIR (default
# /tmp/shmloader-compat) holds the venvs, kept for the next run.
set -euo pipefail
torch_version=${1:?usage: tools/compat.sh TORCH [PYTHON] [-- PYTEST ARGS]}
shift
python_version=3.11
if [[ $# -gt 0 && $1 != -- ]]; then python_version=$1; shift; fi
[[ $# -gt 0 && $1 == -- ]] && shift
# torch's own collate before 2.10 fails on numpy 2.3+'s np.bool_ (a torch bug).
case $torch_version in
    2.6.*|2.7.*|2.8.*|2.9.*) default_numpy="numpy<2.3" ;;
    *) default_numpy="numpy" ;;
esac
numpy=${NUMPY:-$default_numpy}

repo=$(cd "$(dirname "$0")/.." && pwd)
# pyenv's interpreter of that version first (its shims answer only for the
# versions a project selects), else the one on PATH.
python=
if command -v pyenv >/dev/null; then
    python=$(ls -d "$(pyenv root)/versions/$python_version"*/bin/python 2>/dev/null | tail -1)
fi
[[ -n $python ]] || python=$(command -v "python$python_version" || true)
[[ -x $python ]] || { echo "no python$python_version found (pyenv or PATH)" >&2; exit 2; }

where=${COMPAT_DIR:-/tmp/shmloader-compat}/torch-$torch_version-py$python_version
mkdir -p "$where"
[[ -x $where/venv/bin/python ]] || "$python" -m venv "$where/venv"
. "$where/venv/bin/activate"
# The torch asked for, whatever cap pip's configuration puts on torch (some
# machines pin it with a constraint file); pip's notes on local index
# folders that do not exist are dropped.
quiet_pip() {
    PIP_CONSTRAINT=/dev/null pip install --quiet "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}
quiet_pip "torch==$torch_version" "$numpy"
# A copy of the tree, so that building the extension here never rewrites
# the .so that another venv's processes have mapped.
rm -rf "$where/src"
mkdir "$where/src"
(cd "$repo" && git ls-files --cached --others --exclude-standard -z \
    | xargs -0 cp --parents -t "$where/src")
cd "$where/src"
quiet_pip -e ".[test]"
python -c 'import sys, torch, numpy; print(f"torch {torch.__version__}, numpy {numpy.__version__}, Python {sys.version.split()[0]}")'
exec python -m pytest -q tests "$@"
