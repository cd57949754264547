#!/usr/bin/env bash
# Create .venv with pdbroker and everything its tests and demo need. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# dev brings every extra. vllm (the vLLM connector's extra) pins torch==2.14.0: the PyPI
# build, CUDA libraries included (about 5 GB); it runs on machines without a GPU too.
python -m pip install --quiet -e ".[dev]"
