#!/usr/bin/env bash
# Set up (if needed) and run the main job: the end-to-end demo on the embedded default store.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
. .venv/bin/activate
exec pdbroker demo "$@"
