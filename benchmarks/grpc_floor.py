"""What Python gRPC alone allows on this machine: a grpc.aio server answering each request
with ``--response-bytes`` of bytes (default 1.4 KB, about a plan's size), optionally after
spinning ``--handler-us`` of Python or awaiting ``--wait-us`` (as a client waits for a busy
broker: a client's loop that goes idle costs it a wake-up), loaded by asyncio clients on loopback like
``benchmarks/plan_throughput.py``'s. Each way of ``--ways`` runs in turn: ``unary`` (one
unary call per request) and ``stream`` (one bidirectional stream per client, a request
written and its answer read per exchange).

No protobuf, no broker: prints per way calls/s, client-side p50/p99, and CPU per call of the
server process and of the clients, and each way's CPU against the first's. Run it under
another grpcio (a venv with only ``grpcio``) to compare versions; it needs nothing else.

    python benchmarks/grpc_floor.py --clients 2 --client-procs 2 --handler-us 150
    python benchmarks/grpc_floor.py --clients 2 --client-procs 2 --response-bytes 32768 --ways unary,stream
    python benchmarks/grpc_floor.py --clients 1 --ways stream --response-bytes 32768 --wait-us 2000
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

METHODS = {"unary": "/floor.Floor/Call", "stream": "/floor.Floor/Session"}
REQUEST = b"r" * 64


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process ``pid`` (all threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve(port: int, handler_us: float, response_bytes: int, wait_us: float) -> None:
    response = b"x" * response_bytes

    def answer() -> bytes:
        until = time.perf_counter() + handler_us / 1e6
        while time.perf_counter() < until:
            pass
        return response

    async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if wait_us:
            await asyncio.sleep(wait_us / 1e6)
        return answer()

    async def session(requests, context: grpc.aio.ServicerContext):
        async for _ in requests:
            if wait_us:
                await asyncio.sleep(wait_us / 1e6)
            yield answer()

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        handlers = {
            "Call": grpc.unary_unary_rpc_method_handler(call),
            "Session": grpc.stream_stream_rpc_method_handler(session),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("floor.Floor", handlers),)
        )
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print(bound, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def clients(address: str, way: str, count: int, calls: int, go, out) -> None:
    """``count`` clients, each on its own channel, ``calls`` calls each once ``go`` is set,
    ``way`` being ``unary`` or ``stream``."""

    async def main() -> tuple[list[int], float]:
        channels = [grpc.aio.insecure_channel(address) for _ in range(count)]
        if way == "unary":
            stubs = [c.unary_unary(METHODS[way]) for c in channels]
            exchanges = list(stubs)
        else:
            streams = [c.stream_stream(METHODS[way])() for c in channels]

            def exchange(stream):
                async def once(request: bytes) -> bytes:
                    await stream.write(request)
                    return await stream.read()

                return once

            exchanges = [exchange(s) for s in streams]
        await asyncio.gather(*(e(REQUEST) for e in exchanges))
        out.put("ready")
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        latencies: list[int] = []

        async def lane(once) -> None:
            for _ in range(calls):
                t0 = time.perf_counter_ns()
                await once(REQUEST)
                latencies.append(time.perf_counter_ns() - t0)

        cpu = time.process_time()
        await asyncio.gather(*(lane(e) for e in exchanges))
        cpu = time.process_time() - cpu
        if way == "stream":
            for s in streams:
                await s.done_writing()
        await asyncio.gather(*(c.close() for c in channels))
        return latencies, cpu

    out.put(asyncio.run(main()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4, help="clients per process")
    parser.add_argument("--client-procs", type=int, default=1)
    parser.add_argument("--calls", type=int, default=12_000, help="calls in all, per way")
    parser.add_argument("--handler-us", type=float, default=0.0, help="Python spun per call")
    parser.add_argument("--response-bytes", type=int, default=1400, help="bytes of each answer")
    parser.add_argument(
        "--wait-us", type=float, default=0.0, help="the server awaits this long before each answer"
    )
    parser.add_argument("--ways", default="unary", help="comma-separated: unary, stream")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    ways = args.ways.split(",")
    if not set(ways) <= set(METHODS):
        parser.error(f"--ways: each of {', '.join(METHODS)}, not {args.ways!r}")
    if args.serve is not None:
        serve(args.serve, args.handler_us, args.response_bytes, args.wait_us)
        return 0
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "0", "--handler-us", str(args.handler_us)]
        + ["--response-bytes", str(args.response_bytes), "--wait-us", str(args.wait_us)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    address = f"127.0.0.1:{server.stdout.readline().strip()}"
    print(
        f"grpcio {grpc.__version__}, handler {args.handler_us:g} us, wait {args.wait_us:g} us, "
        f"{args.response_bytes} bytes an answer, {args.clients} clients x {args.client_procs} "
        "procs:"
    )
    first: tuple[float, float] | None = None
    try:
        for way in ways:
            n, seconds, latencies, server_cpu, client_cpu = _run(way, address, server.pid, args)
            first = first or (server_cpu, client_cpu)
            print(
                f"  {way:>6}: {n / seconds:,.0f} calls/s, p50 {latencies[n // 2] / 1e6:.2f} ms, "
                f"p99 {latencies[int(n * 0.99)] / 1e6:.2f} ms; CPU per call: server "
                f"{server_cpu:.0f} us ({server_cpu / first[0]:.2f}x {ways[0]}), clients "
                f"{client_cpu:.0f} us ({client_cpu / first[1]:.2f}x {ways[0]})"
            )
    finally:
        server.kill()
    return 0


def _run(way: str, address: str, server_pid: int, args: argparse.Namespace) -> tuple:
    """One way's calls: their count, seconds, sorted latencies (ns), server and client CPU
    per call (us)."""
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Event()
    per_client = args.calls // (args.clients * args.client_procs)
    procs = [
        ctx.Process(target=clients, args=(address, way, args.clients, per_client, go, out))
        for _ in range(args.client_procs)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        out.get()
    cpu, start = cpu_seconds(server_pid), time.perf_counter()
    go.set()
    results = [out.get() for _ in procs]
    seconds = time.perf_counter() - start
    cpu = cpu_seconds(server_pid) - cpu
    for p in procs:
        p.join()
    latencies = sorted(x for r, _ in results for x in r)
    n = len(latencies)
    return n, seconds, latencies, cpu / n * 1e6, sum(c for _, c in results) / n * 1e6


if __name__ == "__main__":
    sys.exit(main())
