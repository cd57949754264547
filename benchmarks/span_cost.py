"""CPU per span of the broker's tracer: in the process that records spans, and in its
exporter child (``python -m broker.span_exporter``) that encodes and sends them over OTLP.

Records ``--spans`` spans shaped like ``broker.plan`` (a stored publisher ``traceparent`` as
parent, the plan's attributes, a ``traceparent`` formatted from the span) through
``install_broker_tracing`` at ``--rate`` spans a second (a busy broker's plan
rate: it sets how many spans each frame and export request carry), exporting over OTLP/gRPC
to a receiver in another process (on idle CPU time). The recording side is the CPU time of the span calls (this
thread) and of the provider's shipping thread that frames them into the pipe (from
``/proc``); the child's is read from ``/proc`` once the receiver holds every span, less what
it had used when it sat idle before the first span.

    .venv/bin/python benchmarks/span_cost.py --spans 20000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import multiprocessing.connection
import os
import secrets
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker import tracing
from broker.span_tracer import install_broker_tracing
from harness.bench_engines import cpu_seconds
from harness.trace_receiver import TraceReceiver


def thread_cpu_seconds(native_id: int) -> float:
    """User + system CPU time of one thread of this process, from /proc (Linux)."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _receiver_process(conn: mp.connection.Connection) -> None:
    """An OTLP receiver on idle CPU time: sends its environment, then answers each message
    with the number of spans received (``stop`` ends it)."""
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    with TraceReceiver() as receiver:
        conn.send(receiver.environment())
        while conn.recv() != "stop":
            with receiver._lock:
                conn.send(
                    sum(
                        len(s.spans)
                        for r in receiver._requests
                        for rs in r.resource_spans
                        for s in rs.scope_spans
                    )
                )


def record(count: int, traceparents: list[str]) -> None:
    """``count`` spans like the broker's ``broker.plan`` ones."""
    for i in range(count):
        with tracing.span(
            "broker.plan",
            traceparents[i % len(traceparents)],
            {"pdbroker.transfer_id": f"t{i}", "pdbroker.decode_rank": i & 1},
        ) as span:
            tracing.span_traceparent(span)
            assert span is not None
            span.set_attributes(
                {
                    "pdbroker.source_ranks": [0, 1],
                    "pdbroker.descriptors": 1234,
                    "pdbroker.bytes": 56_789_012,
                    "pdbroker.cache_hit": True,
                }
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=1000.0, help="spans a second")
    parser.add_argument("--timeout", type=float, default=120.0, help="for the export, seconds")
    args = parser.parse_args()
    conn, child_conn = mp.Pipe()
    receiver = mp.get_context("spawn").Process(target=_receiver_process, args=(child_conn,))
    receiver.start()
    try:
        os.environ.update(conn.recv())
        provider = install_broker_tracing("span-cost")
        assert provider is not None
        child = provider.pipe.child_pid
        traceparents = [f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01" for _ in range(64)]
        record(1000, traceparents)  # warm-up: imports, the child's first export, the channel
        provider.force_flush()
        while (conn.send("count"), conn.recv())[1] < 1000:
            time.sleep(0.05)
        time.sleep(0.5)
        shipping = provider.pipe.shipping_thread_id
        assert shipping is not None
        child_before, ship_before = cpu_seconds(child), thread_cpu_seconds(shipping)
        step = max(1, int(args.rate / 50))  # every 20 ms
        start, recorded = time.monotonic(), 0.0
        for done in range(0, args.spans, step):
            time.sleep(max(0.0, start + done / args.rate - time.monotonic()))
            before = time.thread_time()
            record(min(step, args.spans - done), traceparents)
            recorded += time.thread_time() - before
        provider.force_flush()
        shipped = thread_cpu_seconds(shipping) - ship_before
        deadline = time.monotonic() + args.timeout
        while (conn.send("count"), conn.recv())[1] < 1000 + args.spans:
            if time.monotonic() > deadline:
                raise SystemExit("the receiver did not get every span in time")
            provider.force_flush()
            time.sleep(0.05)
        child_used = cpu_seconds(child) - child_before
        provider.shutdown()
        conn.send("stop")
    finally:
        receiver.join(10)
        receiver.kill()
    print(
        f"{args.spans} spans at {args.rate:g}/s: recording {recorded / args.spans * 1e6:.1f} "
        f"+ shipping {shipped / args.spans * 1e6:.1f} us/span (broker side), "
        f"exporting {child_used / args.spans * 1e6:.1f} us/span (child)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
