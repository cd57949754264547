"""What each call leaves a broker process's garbage collector: a ``pdbroker serve`` under
``benchmarks/gc_probe`` is sent ``--calls`` ``ListEngines`` calls (each on a channel of its
own, the handler doing nearly nothing), and the probe counts, by type, what a full
collection frees before and after them. Printed: the objects each call left, by type.

    .venv/bin/python benchmarks/gc_garbage.py --calls 1000
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.brokers import BrokerProcess

HERE = Path(__file__).resolve().parent


def census(broker: BrokerProcess, folder: Path, n: int) -> Counter[str]:
    """The probe's ``n``-th census of ``broker`` (signalled, then awaited)."""
    os.kill(broker.process.pid, signal.SIGUSR1)
    path = folder / f"{broker.process.pid}-garbage-{n}.json"
    deadline = time.monotonic() + 10
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no census from the broker in {folder}")
        time.sleep(0.05)
    time.sleep(0.1)  # written whole
    return Counter(dict(json.loads(path.read_text())))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        folder = Path(directory)
        os.environ["PDBROKER_GC_PROBE_DIR"] = directory
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(HERE.parent), str(HERE / "gc_probe"), os.environ.get("PYTHONPATH", "")]
        )
        broker = BrokerProcess()
        try:
            broker.list_engines()  # the server's first call made
            before = census(broker, folder, 0)
            for _ in range(args.calls):
                broker.list_engines()
            after = census(broker, folder, 1)
        finally:
            broker.stop()
    left = after - before
    print(f"{args.calls} ListEngines calls left {left.total():,} objects for the collector:")
    for name, count in left.most_common(10):
        print(f"  {count / args.calls:6.2f} a call  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
