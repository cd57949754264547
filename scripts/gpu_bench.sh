#!/usr/bin/env bash
# GPU transfer figures on a GPU host (see docs/BENCHMARKS.md): VRAM->VRAM through
# NIXL/UCX between two processes vs torch's device-to-device copy, under several UCX
# configurations. Expects NIXL wheels (nixl, nixl-cu12 or nixl-cu13) for the machine's Python
# in .whl/ (`pip download --no-deps` them where a registry is reachable); writes
# results.jsonl (one line per configuration),
# logs.txt and gpu.txt to ${OUT:-out}.
# Usage: bash scripts/gpu_bench.sh [prefill_gpu] [decode_gpu]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
P=${1:-0}; D=${2:-0}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NIXL_LOG_LEVEL=WARN PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
nvidia-smi topo -m >> "$OUT/gpu.txt" 2>&1
bench() {  # name, then env assignments; runs the transfer bench for one configuration
  local name=$1; shift
  echo "== $name: $*"
  env "$@" timeout 150 python3 -c '
import argparse, sys
from broker.commands import bench
parser = argparse.ArgumentParser(); sub = parser.add_subparsers(dest="command")
bench.register(sub)
args = parser.parse_args(sys.argv[1:]); sys.exit(args.run(args))
' bench transfer --device cuda --prefill-device "$P" --decode-device "$D" --repeats 5 \
    --json > /tmp/bench.json 2> /tmp/bench.log
  local rc=$?
  echo "{\"config\": \"$name\", \"env\": \"$*\", \"rc\": $rc, \"result\": $(tail -n 1 /tmp/bench.json | grep '^{' || echo null)}" >> "$OUT/results.jsonl"
  { echo "== $name ($*) rc=$rc"; cat /tmp/bench.log; } >> "$OUT/logs.txt"
  tail -n 1 "$OUT/results.jsonl"; tail -n 3 /tmp/bench.log
}
bench default
bench no_err_handling PDBROKER_UCX_PARAMS=ucx_error_handling_mode=none
bench cuda_tls PDBROKER_UCX_PARAMS=ucx_error_handling_mode=none UCX_TLS=cuda_ipc,cuda_copy,sm,self
bench cuda_tls_tcp UCX_TLS=cuda_ipc,cuda_copy,tcp,self
bench proto_info PDBROKER_UCX_PARAMS=ucx_error_handling_mode=none UCX_TLS=cuda_ipc,cuda_copy,sm,self UCX_PROTO_INFO=y UCX_LOG_LEVEL=info
exit 0
