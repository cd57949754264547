"""What Python gRPC alone allows on this machine: a grpc.aio server whose one unary method
returns 1.4 KB of bytes (about a plan's size), optionally after spinning ``--handler-us`` of
Python, loaded by asyncio clients on loopback like ``benchmarks/plan_throughput.py``'s.

No protobuf, no broker: prints calls/s, client-side p50/p99, and CPU per call of the server
process and of the clients. Run it under another grpcio (a venv with only ``grpcio``) to
compare versions; it needs nothing else.

    python benchmarks/grpc_floor.py --clients 2 --client-procs 2 --handler-us 150
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import subprocess
import sys
import time

import grpc

METHOD = "/floor.Floor/Call"
RESPONSE = b"x" * 1400


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process ``pid`` (all threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve(port: int, handler_us: float) -> None:
    async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        until = time.perf_counter() + handler_us / 1e6
        while time.perf_counter() < until:
            pass
        return RESPONSE

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        handler = grpc.unary_unary_rpc_method_handler(call)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("floor.Floor", {"Call": handler}),)
        )
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print(bound, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def clients(address: str, count: int, calls: int, go, out) -> None:
    """``count`` clients, each on its own channel, ``calls`` calls each once ``go`` is set."""

    async def main() -> tuple[list[int], float]:
        channels = [grpc.aio.insecure_channel(address) for _ in range(count)]
        stubs = [c.unary_unary(METHOD) for c in channels]
        await asyncio.gather(*(s(b"r" * 64) for s in stubs))
        out.put("ready")
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        latencies: list[int] = []

        async def lane(stub) -> None:
            for _ in range(calls):
                t0 = time.perf_counter_ns()
                await stub(b"r" * 64)
                latencies.append(time.perf_counter_ns() - t0)

        cpu = time.process_time()
        await asyncio.gather(*(lane(s) for s in stubs))
        cpu = time.process_time() - cpu
        await asyncio.gather(*(c.close() for c in channels))
        return latencies, cpu

    out.put(asyncio.run(main()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4, help="clients per process")
    parser.add_argument("--client-procs", type=int, default=1)
    parser.add_argument("--calls", type=int, default=12_000, help="calls in all")
    parser.add_argument("--handler-us", type=float, default=0.0, help="Python spun per call")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.handler_us)
        return 0
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "0", "--handler-us", str(args.handler_us)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    address = f"127.0.0.1:{server.stdout.readline().strip()}"
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Event()
    per_client = args.calls // (args.clients * args.client_procs)
    procs = [
        ctx.Process(target=clients, args=(address, args.clients, per_client, go, out))
        for _ in range(args.client_procs)
    ]
    try:
        for p in procs:
            p.start()
        for _ in procs:
            out.get()
        cpu, start = cpu_seconds(server.pid), time.perf_counter()
        go.set()
        results = [out.get() for _ in procs]
        seconds, cpu = time.perf_counter() - start, cpu_seconds(server.pid) - cpu
        for p in procs:
            p.join()
    finally:
        server.kill()
    latencies = sorted(x for r, _ in results for x in r)
    n = len(latencies)
    print(
        f"grpcio {grpc.__version__}, handler {args.handler_us:g} us, {args.clients} clients x "
        f"{args.client_procs} procs: {n / seconds:,.0f} calls/s, p50 "
        f"{latencies[n // 2] / 1e6:.2f} ms, p99 {latencies[int(n * 0.99)] / 1e6:.2f} ms; CPU "
        f"per call: server {cpu / n * 1e6:.0f} us, clients "
        f"{sum(c for _, c in results) / n * 1e6:.0f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
