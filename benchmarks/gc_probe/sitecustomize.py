"""Times every garbage collection of a ``pdbroker serve`` process: with this folder on
``PYTHONPATH`` and ``PDBROKER_GC_PROBE_DIR`` set, each broker process the command starts
writes ``<pid>.json`` there when it exits (seconds since start, generation, ms, objects
collected); ``benchmarks/gc_pauses.py DIR`` summarises them.

    PDBROKER_GC_PROBE_DIR=/tmp/gc PYTHONPATH=.:benchmarks/gc_probe \\
        .venv/bin/python -m broker.cli bench scale --engines 256 --held 100 --tp 8 \\
        --samples 100 --lease-ttl-ms 20000
    .venv/bin/python benchmarks/gc_pauses.py /tmp/gc
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import time
from pathlib import Path

_DIR = os.environ.get("PDBROKER_GC_PROBE_DIR")

if _DIR and "serve" in sys.argv:
    _started = time.monotonic()
    _records: list[tuple[float, int, float, int]] = []
    _collection_start = [0.0]

    def _timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            _collection_start[0] = time.perf_counter()
            return
        ms = (time.perf_counter() - _collection_start[0]) * 1e3
        since = time.monotonic() - _started
        _records.append((round(since, 3), info["generation"], round(ms, 2), info["collected"]))

    def _write() -> None:
        path = Path(_DIR) / f"{os.getpid()}.json"
        path.write_text(json.dumps({"argv": sys.argv, "collections": _records}))

    gc.callbacks.append(_timed)
    atexit.register(_write)
