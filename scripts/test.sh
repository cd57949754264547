#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# Services the tests start themselves: redis-server (Redis store tests) and ip (network
# namespace tests). Installed with apt where missing and we are root; otherwise those tests
# skip and say why.
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v ip >/dev/null || missing+=(iproute2)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test.sh: installing ${missing[*]}"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") >/dev/null \
      || echo "test.sh: could not install ${missing[*]}; their tests will skip or fail" >&2
  else
    echo "test.sh: ${missing[*]} missing and not installable here (needs root and apt-get)" >&2
  fi
fi
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest "$@"
