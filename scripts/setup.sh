#!/usr/bin/env bash
# Create .venv and install pdbroker into it (editable). Usage: scripts/setup.sh [full|demo]
#   full (default): every extra (.[dev]): what the tests, the vLLM connector and the
#                   benchmarks need, vLLM and the PyPI build of torch (CUDA libraries included)
#   demo:           what `pdbroker demo` needs: the package and NIXL, without the torch that
#                   NIXL's wheel names (the demo's engines register numpy arrays)
# Runs pip only when .venv holds no install of this pyproject.toml and this script in that
# mode; a full install serves the demo too.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-full}
NIXL_VERSION=1.5.1
case "$mode" in
  full | demo) ;;
  *) echo "usage: scripts/setup.sh [full|demo]" >&2; exit 2 ;;
esac
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
stamp=.venv/pdbroker-installed
key=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if grep -qxE "(full|$mode) $key" "$stamp" 2>/dev/null; then
  exit 0
fi
rm -f "$stamp"
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
if [ "$mode" = demo ]; then
  python -m pip install --quiet -e .
  python -m pip install --quiet --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"
else
  python -m pip install --quiet -e ".[dev]"
fi
echo "$mode $key" >"$stamp"
