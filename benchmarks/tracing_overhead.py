"""GetTransferPlan throughput with tracing off vs on, side by side in one run.

Starts two ``pdbroker serve`` processes, identical but for the environment: one with tracing
off (no ``OTEL_*``), one exporting every span over OTLP/gRPC (from its exporter child
process, as ``serve`` does) to an OTLP receiver. The receiver stands in for a collector on
another host: it runs in its own process on idle CPU time only, so that decoding spans takes
CPU from neither broker (the traced broker's exporter child is charged, as in serving). Both get the same engines
(Nemotron-3-Nano-like, fake addresses) and the same transfers, published with a W3C
``traceparent`` as a tracing prefill client sends it, so the traced broker records one
``broker.plan`` span per plan (and ``broker.publish`` ones before the timing).

Each round runs both brokers *at the same time* for ``--seconds``: one client process per
broker, ``--clients`` concurrent decode clients each, all released by one signal and stopped
by one deadline. Both brokers thus share whatever else the machine is doing during the round,
and the ratio of their plan rates within a round is the throughput change tracing causes;
the result is the median over rounds. Broker CPU per plan comes from ``/proc``.
``--plan-context`` makes the plan calls carry a decode-side ``traceparent`` too (the broker
then also links it: the costlier case).

    .venv/bin/python benchmarks/tracing_overhead.py            # 11 rounds of 3 s, ~2.5 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.synchronize
import os
import secrets
import statistics
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.presets import resolve_model
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from broker.wire import Role
from harness.bench_engines import DECODE_ADDR, PREFILL_ADDR, cpu_seconds, register
from harness.brokers import BrokerProcess
from harness.scenarios import Scenario, build_scenario
from harness.trace_receiver import TraceReceiver

#: The largest throughput loss tracing may cost.
MAX_LOSS = 0.10
MODES = ("off", "on")


def traceparent() -> str:
    """A fresh sampled W3C traceparent, as a client span would send it."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


async def _client(
    channel: grpc.aio.Channel,
    rank: int,
    transfers: list[str],
    ids: list[pb.BlockIds],
    context: bool,
    deadline: float,
) -> int:
    """Plan ``transfers`` in order as decode rank ``rank`` until ``deadline``; returns how
    many plans completed (-1 if the list ran out first)."""
    stub = pb_grpc.BrokerStub(channel)
    for done, transfer_id in enumerate(transfers):
        if time.perf_counter() >= deadline:
            return done
        await stub.GetTransferPlan(
            pb.GetTransferPlanRequest(
                transfer_id=transfer_id, engine_id="D", tp_rank=rank, block_ids=ids
            ),
            metadata=(("traceparent", traceparent()),) if context else None,
        )
    return -1


def _client_process(
    address: str,
    jobs: list[tuple[int, list[str]]],
    decode_ids: list[list[int]],
    context: bool,
    seconds: float,
    go: mp.synchronize.Event,
    out: mp.Queue,
) -> None:
    """Connect every client, say ``ready``, wait for ``go``, plan for ``seconds``; send the
    plans completed (-1: some client ran out of transfers)."""
    ids = [pb.BlockIds(ids=g) for g in decode_ids]

    async def main() -> None:
        channels = [grpc.aio.insecure_channel(address) for _ in jobs]
        await asyncio.gather(*(c.channel_ready() for c in channels))
        out.put("ready")
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        deadline = time.perf_counter() + seconds
        counts = await asyncio.gather(
            *(_client(c, r, t, ids, context, deadline) for c, (r, t) in zip(channels, jobs))
        )
        out.put(-1 if -1 in counts else sum(counts))
        await asyncio.gather(*(c.close() for c in channels))

    asyncio.run(main())


def run_round(
    brokers: dict[str, BrokerProcess],
    transfers: dict[str, list[str]],
    args: argparse.Namespace,
    decode_ids: list[list[int]],
) -> dict[str, tuple[float, float]]:
    """Both brokers at once for ``args.seconds``: per mode, plans per second, broker CPU
    microseconds per plan and plans."""
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    per_rank = args.clients // args.decode_tp
    procs, queues = {}, {}
    for mode in MODES:
        names = transfers[mode]
        jobs = [
            (c % args.decode_tp, names[c // args.decode_tp :: per_rank])
            for c in range(args.clients)
        ]
        queues[mode] = ctx.Queue()
        procs[mode] = ctx.Process(
            target=_client_process,
            args=(brokers[mode].address, jobs, decode_ids, args.plan_context, args.seconds,
                  go, queues[mode]),
        )  # fmt: skip
        procs[mode].start()
    for mode in MODES:
        if queues[mode].get() != "ready":
            raise SystemExit("a client process did not connect")
    cpu = {mode: cpu_seconds(brokers[mode].process.pid) for mode in MODES}
    go.set()
    plans = {mode: queues[mode].get() for mode in MODES}
    cpu = {mode: cpu_seconds(brokers[mode].process.pid) - cpu[mode] for mode in MODES}
    for proc in procs.values():
        proc.join()
        if proc.exitcode:
            raise SystemExit(f"a client process failed (exit code {proc.exitcode})")
    if -1 in plans.values():
        raise SystemExit("the clients ran out of transfers: raise --transfers")
    return {m: (plans[m] / args.seconds, cpu[m] / max(plans[m], 1) * 1e6, plans[m]) for m in MODES}


def prepare(broker: BrokerProcess, sc: Scenario, count: int) -> list[str]:
    """Register both engines and publish ``count`` transfers, each with a traceparent."""
    with grpc.insecure_channel(broker.address) as channel:
        stub = pb_grpc.BrokerStub(channel)
        register(stub, sc.prefill, "P", Role.PREFILL, PREFILL_ADDR)
        register(stub, sc.decode, "D", Role.DECODE, DECODE_ADDR)
        p_ids = [pb.BlockIds(ids=g) for g in sc.request.prefill_block_ids]
        names = [f"t{i}" for i in range(count)]
        for name in names:
            stub.PublishBlocks(
                pb.PublishBlocksRequest(
                    transfer_id=name,
                    engine_id="P",
                    block_ids=p_ids,
                    num_tokens=sc.request.num_tokens,
                ),
                metadata=(("traceparent", traceparent()),),
            )
    return names


def _receiver_process(conn: mp.connection.Connection) -> None:
    """An OTLP receiver on idle CPU time: sends its environment, then answers each message
    but ``stop`` with the numbers of ``broker.plan`` spans and of all spans received so far."""
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    with TraceReceiver() as receiver:
        conn.send(receiver.environment())
        while conn.recv() != "stop":
            spans = receiver.spans()
            conn.send((sum(s.name == "broker.plan" for s in spans), len(spans)))


def exporter_pid(broker: BrokerProcess) -> int | None:
    """The pid of the broker's span exporter child (``python -m broker.span_exporter``)."""
    proc = Path(f"/proc/{broker.process.pid}")
    for children in proc.glob("task/*/children"):
        for pid in children.read_text().split():
            if b"broker.span_exporter" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
    return None


def received(conn: mp.connection.Connection) -> tuple[int, int]:
    """``broker.plan`` spans and all spans the receiver holds."""
    conn.send("count")
    return conn.recv()


def drained(conn: mp.connection.Connection, plans: int, timeout_s: float = 60.0) -> int:
    """Wait (up to ``timeout_s``) until the receiver holds ``plans`` ``broker.plan`` spans
    (the last the traced broker made); returns how many spans it holds."""
    deadline = time.monotonic() + timeout_s
    while (counts := received(conn))[0] < plans and time.monotonic() < deadline:
        time.sleep(0.5)
    return counts[1]


def start_brokers(receiver: dict[str, str], transfers: int) -> dict[str, BrokerProcess]:
    """The two brokers: ``off`` without any ``OTEL_*`` variable, ``on`` exporting to
    the receiver whose environment is ``receiver``."""
    flags = ("--max-transfers", str(transfers + 100), "--default-ttl-ms", "3600000",
             "--lease-ttl-ms", "3600000")  # fmt: skip
    saved = dict(os.environ)
    try:
        for name in [k for k in os.environ if k.startswith("OTEL_")]:
            del os.environ[name]
        brokers = {"off": BrokerProcess(*flags)}
        os.environ.update(receiver)
        brokers["on"] = BrokerProcess(*flags)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return brokers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="nemotron-3-nano-30b-a3b")
    parser.add_argument("--prefill-tp", type=int, default=2)
    parser.add_argument("--decode-tp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--clients", type=int, default=4, help="decode clients per broker")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of a round")
    parser.add_argument(
        "--transfers", type=int, default=2000, help="published per broker and round"
    )
    parser.add_argument(
        "--plan-context", action="store_true", help="plan calls carry a traceparent too"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.clients % args.decode_tp:
        parser.error("--clients must be a multiple of --decode-tp")

    sc = build_scenario(resolve_model(args.model), args.prefill_tp, args.decode_tp, args.tokens)
    decode_ids = [list(g) for g in sc.request.decode_block_ids]
    total = args.transfers * (args.rounds + 1)  # one untimed warm-up round
    samples: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    traced_plans = exported_before = 0
    exporter_cpu = 0.0
    conn, child_conn = mp.Pipe()
    receiver = mp.get_context("spawn").Process(target=_receiver_process, args=(child_conn,))
    receiver.start()
    try:
        brokers = start_brokers(conn.recv(), total)
        try:
            names = {mode: prepare(b, sc, total) for mode, b in brokers.items()}
            exporter = exporter_pid(brokers["on"])
            for r in range(args.rounds + 1):
                batch = slice(r * args.transfers, (r + 1) * args.transfers)
                if r == 1:  # the exporter child's CPU from here to the end of its export
                    exporter_cpu = -cpu_seconds(exporter) if exporter else 0.0
                    exported_before = received(conn)[1]
                result = run_round(brokers, {m: names[m][batch] for m in MODES}, args, decode_ids)
                traced_plans += result["on"][2]
                if r:
                    for mode in MODES:
                        samples[mode].append(result[mode][:2])
            exported = drained(conn, traced_plans) - exported_before
            if exporter:
                exporter_cpu += cpu_seconds(exporter)
        finally:
            for broker in brokers.values():
                broker.stop()  # the traced one flushes its spans
        plan_spans = received(conn)[0]
        conn.send("stop")
    finally:
        receiver.kill()
    # Spans exported from the first timed round on (some may be of the warm-up round).
    exporter_us = exporter_cpu / exported * 1e6 if exporter and exported else None

    ratios = [on / off for (off, _), (on, _) in zip(samples["off"], samples["on"])]
    loss = 1 - statistics.median(ratios)
    rate = {m: statistics.median(x for x, _ in samples[m]) for m in MODES}
    cpu = {m: statistics.median(c for _, c in samples[m]) for m in MODES}
    summary = {
        "model": args.model,
        "prefill_tp": args.prefill_tp,
        "decode_tp": args.decode_tp,
        "tokens": args.tokens,
        "clients_per_broker": args.clients,
        "plan_context": args.plan_context,
        "rounds": args.rounds,
        "seconds_per_round": args.seconds,
        "cpus": os.cpu_count(),
        "off_plans_per_s": [round(x, 1) for x, _ in samples["off"]],
        "on_plans_per_s": [round(x, 1) for x, _ in samples["on"]],
        "on_off_ratios": [round(r, 3) for r in ratios],
        "off_median_plans_per_s": round(rate["off"], 1),
        "on_median_plans_per_s": round(rate["on"], 1),
        "off_broker_cpu_us_per_plan": round(cpu["off"], 1),
        "on_broker_cpu_us_per_plan": round(cpu["on"], 1),
        "exporter_cpu_us_per_span": None if exporter_us is None else round(exporter_us, 1),
        "throughput_loss": round(loss, 4),
        "plans_on_traced_broker": traced_plans,
        "plan_spans_exported": plan_spans,
        "within_limit": loss < MAX_LOSS,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"{args.model} {args.tokens} tokens, P TP{args.prefill_tp} -> D TP{args.decode_tp}; "
            f"{args.rounds} rounds of {args.seconds:g} s, both brokers at once, "
            f"{args.clients} clients each, on {summary['cpus']} CPUs"
        )
        for mode in MODES:
            rates = ", ".join(f"{x:,.0f}" for x, _ in samples[mode])
            print(
                f"tracing {mode:>3}: median {rate[mode]:,.0f} plans/s (rounds: {rates}); "
                f"broker CPU {cpu[mode]:.0f} us/plan"
            )
        print(
            f"broker.plan spans received from the traced broker: {plan_spans} "
            f"for its {traced_plans} plans"
        )
        if exporter_us is not None:
            print(
                f"its span exporter child: {exporter_us:.1f} us CPU per span "
                f"({exporter_cpu:.2f} s for the {exported} spans exported from round 1 on)"
            )
        print(
            f"throughput change with tracing on (median of the rounds' on/off ratios "
            f"{', '.join(f'{r:.3f}' for r in ratios)}): {-100 * loss:+.1f}% "
            f"(limit -{100 * MAX_LOSS:.0f}%): {'within' if loss < MAX_LOSS else 'OVER'}"
        )
    return 0 if loss < MAX_LOSS else 1


if __name__ == "__main__":
    sys.exit(main())
