#!/usr/bin/env bash
# Regenerate broker/v1/ (messages, gRPC stubs, type stubs) from protos/broker/v1/*.proto.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# -I protos with files under protos/broker/v1 makes the generated imports `broker.v1.*`.
"$PY" -m grpc_tools.protoc -I protos \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  protos/broker/v1/*.proto
touch broker/v1/__init__.py
