"""``pdbroker bench control-plane``: plans and reports over gRPC, unary and batched, side by
side in one run (:mod:`harness.control_plane_bench`), against vLLM's own decode-side work
for the same request, with each target and whether it is met."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from broker.commands.options import non_negative_int, positive_float, positive_int, positive_ints
from broker.config import STORE_THREADS
from broker.console import Progress

if TYPE_CHECKING:
    from harness.scenarios import Scenario


def add_control_plane(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``control-plane`` kind of ``pdbroker bench``."""
    control = kinds.add_parser(
        "control-plane",
        help="plans and reports over gRPC, unary and batched, vs concurrent clients; first "
        "contact of a new prefill/decode pair; calls per transfer",
    )
    control.add_argument(
        "--clients",
        type=positive_ints,
        default="2",
        help="comma-separated counts of concurrent decode clients",
    )
    control.add_argument(
        "--batch",
        type=positive_ints,
        default="1,4,16,64",
        help="comma-separated entries per plan and per report call, each timed at every "
        "client count; 1 is the unary path (GetTransferPlan, "
        "ReportTransfer), which always runs, and with any larger batch so does the realistic "
        "one (every rank of 8 transfers)",
    )
    control.add_argument(
        "--ways",
        type=ways,
        default="calls,session",
        help="comma-separated ways a batch larger than 1 reaches the broker, each timed one "
        "after the other: calls (GetTransferPlans, ReportTransfers) and session (exchanges on "
        "one EngineSession stream per client)",
    )
    control.add_argument("--seconds", type=positive_float, default=3.0, help="timed per stage")
    control.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="times every stage runs, the ways' order reversed every other round; each "
        "figure is the median of its rounds'",
    )
    control.add_argument(
        "--client-procs", type=positive_int, default=2, help="processes the clients are spread over"
    )
    control.add_argument(
        "--pairs",
        type=positive_int,
        default=20,
        help="new decode engines timed to their first plan, per way",
    )
    control.add_argument(
        "--baseline",
        action="store_true",
        help="also time ListEngines per client count: what gRPC alone allows",
    )
    control.add_argument("--model", default="nemotron-3-nano-30b-a3b", help="a preset name")
    control.add_argument("--prefill-tp", type=positive_int, default=2, help="prefill's TP size")
    control.add_argument("--decode-tp", type=positive_int, default=2, help="decode's TP size")
    control.add_argument(
        "--tokens", type=positive_int, default=32768, help="tokens of the request planned"
    )
    control.add_argument(
        "--profile", type=Path, default=None, help="run the broker under cProfile, stats here"
    )
    control.add_argument(
        "--no-vllm", action="store_true", help="skip vLLM's side even if vLLM is installed"
    )
    control.add_argument(
        "--workers",
        type=positive_ints,
        help="comma-separated worker counts: instead of the above, unary plans/s of a broker "
        "of each count on a private redis-server, side by side, with the host's own parallel "
        "efficiency at as many busy processes (workers + client processes + Redis) and the "
        "limits reached: Redis at 90%% of its core, the host's CPU at 90%% of all cores, the "
        "host's cores where that efficiency (each process's work rate over one alone's) is "
        "below 0.8, a worker's store threads all busy or its turn held 90%% of the time",
    )
    control.add_argument(
        "--store-threads",
        type=positive_ints,
        default=str(STORE_THREADS),
        help="with --workers: comma-separated store threads per worker (pdbroker serve "
        "--store-threads), every worker count run with each",
    )
    control.add_argument(
        "--redis-delay-us",
        type=non_negative_int,
        default=0,
        help="with --workers: the brokers reach Redis through a proxy holding every reply this "
        "long, as a Redis on another host would",
    )
    return control


def ways(text: str) -> tuple[str, ...]:
    """``--ways``: ``calls`` and/or ``session``, comma-separated."""
    chosen = tuple(dict.fromkeys(w.strip() for w in text.split(",") if w.strip()))
    if not chosen or any(w not in ("calls", "session") for w in chosen):
        raise argparse.ArgumentTypeError(f"name calls and/or session, comma-separated: {text!r}")
    return chosen


#: Samples per trial and trials of vLLM's decode-side work in ``bench control-plane``.
VLLM_SAMPLES, VLLM_TRIALS = 300, 5
#: TP sizes whose calls per transfer ``bench control-plane`` counts.
COUNTED_TP = 8


def vllm_decode_us(model: str, sc: Scenario) -> float:
    """vLLM's own decode-side work for ``sc``'s request, every decode rank (µs): the sum over
    the ranks of their lowest median (:data:`~broker.commands.bench.VLLM_SCOPE`)."""
    from broker.commands.bench import lowest_medians_us
    from harness.vllm.nixl_reference import VllmDecodeSide

    total = 0.0
    for rank in range(sc.decode.tp_size):
        side = VllmDecodeSide(model, sc, decode_rank=rank)
        try:
            total += lowest_medians_us([side.sample], VLLM_SAMPLES, VLLM_TRIALS)[0]
        finally:
            side.close()
    return total


def run_control_plane(args: argparse.Namespace, progress: Progress) -> int:
    """Plans and reports over gRPC per client count and batch size, then first contact of
    new pairs and the calls per transfer; vLLM's decode-side work for the same request."""
    from broker.commands.bench import VLLM_SCOPE, _emit
    from broker.presets import resolve_model
    from harness.control_plane_bench import control_plane, realistic_batch
    from harness.scenarios import build_scenario

    model = resolve_model(args.model)
    sc = build_scenario(model, args.prefill_tp, args.decode_tp, args.tokens)
    if args.workers:
        from harness.workers_bench import bench_workers

        return bench_workers(args, progress, sc, _emit)
    count_sc = build_scenario(model, COUNTED_TP, COUNTED_TP, args.tokens)
    batched = {realistic_batch(args.decode_tp)} if max(args.batch) > 1 else set()
    batches = sorted({1, *batched, *args.batch})
    vllm_us = None
    if not args.no_vllm and importlib.util.find_spec("vllm") is not None:
        progress.phase("vLLM's decode-side work for the same request")
        vllm_us = round(vllm_decode_us(args.model, sc), 1)
    r = control_plane(
        sc,
        progress,
        args.clients,
        args.seconds,
        args.client_procs,
        args.pairs,
        args.baseline,
        args.profile,
        batches,
        count_sc,
        args.ways,
        args.rounds,
    )
    r["vllm_decode_us_per_request"] = vllm_us
    r["vllm_scope"] = f"{VLLM_SCOPE}, summed over every decode rank" if vllm_us else None
    r["targets"] = control_plane_targets(r)
    _emit(args, progress, "control_plane", {"control_plane": r}, _control_plane_table(r))
    if args.out:
        _plot_control_plane(r, args.out / "control_plane.png")
    return 0


def control_plane_targets(r: dict) -> list[dict]:
    """Each target of the batched control plane at the realistic batch (per client count),
    its goal, what was measured (by the better way there: ``way``) and whether it is met
    (None: not measured)."""
    from harness.control_plane_bench import (
        TARGET_CALLS_PER_TRANSFER,
        TARGET_ENGINE_CPU_SHARE,
        TARGET_P99_MS,
        TARGET_RANK_PLANS_PER_S,
        TARGET_SPEEDUP,
    )

    targets = []

    def target(
        name: str, goal: str, measured: float | None, met: bool | None, way: str = ""
    ) -> None:
        targets.append({"target": name, "goal": goal, "measured": measured, "met": met, "way": way})

    batch = r["realistic_batch"]
    at_batch = [p for p in r["phases"] if p["batch"] == batch]
    for n in sorted({p["clients"] for p in at_batch}):
        ps = [p for p in at_batch if p["clients"] == n]
        at = f"batch {batch}, {n} clients"
        fast = max(ps, key=lambda p: p["plan_per_s"])
        rate = fast["plan_per_s"]
        target(
            f"rank-plans/s, {at}",
            f">= {TARGET_RANK_PLANS_PER_S:,}",
            rate,
            rate >= TARGET_RANK_PLANS_PER_S,
            fast["way"],
        )
        prompt = min(ps, key=lambda p: p["plan_p99_ms"])
        p99 = prompt["plan_p99_ms"]
        target(
            f"p99 per plan call, {at}",
            f"< {TARGET_P99_MS} ms",
            p99,
            p99 < TARGET_P99_MS,
            prompt["way"],
        )
        speedup = fast["plan_speedup"]
        target(
            f"rank-plans/s against batch 1, {at}",
            f">= {TARGET_SPEEDUP}x",
            speedup,
            speedup >= TARGET_SPEEDUP,
            fast["way"],
        )
        lean = min(ps, key=lambda p: p["engine_cpu_us_per_request"])
        vllm = r["vllm_decode_us_per_request"]
        share = round(lean["engine_cpu_us_per_request"] / vllm, 2) if vllm else None
        target(
            f"decode engine CPU per request against vLLM's own decode-side work, {at}",
            f"<= {TARGET_ENGINE_CPU_SHARE}x",
            share,
            None if share is None else share <= TARGET_ENGINE_CPU_SHARE,
            lean["way"],
        )
    counted = r["calls_per_transfer"]
    if counted:
        calls = counted["batched"]["per_transfer"]
        target(
            f"calls per transfer at TP{counted['prefill_tp']} -> TP{counted['decode_tp']}, "
            "batched, one transfer a call",
            f"<= {TARGET_CALLS_PER_TRANSFER}",
            calls,
            calls <= TARGET_CALLS_PER_TRANSFER,
        )
    fc = r["first_contact"]
    target(
        "first contact of a new pair, batched against per rank (median)",
        "<= 1.0x",
        round(fc["batched"]["median_ms"] / fc["per_rank"]["median_ms"], 2),
        fc["batched"]["median_ms"] <= fc["per_rank"]["median_ms"],
    )
    return targets


def _control_plane_table(r: dict) -> str:
    batch = r["realistic_batch"]
    lines = [
        (
            f"{r['model']} {r['tokens']} tokens TP{r['prefill_tp']}->TP{r['decode_tp']}: "
            f"{r['descriptors_per_plan']} descriptors, {r['bytes_per_plan']:,} bytes per plan; "
            f"{r['cpus']} CPUs, 1-min load average {r['load_average_1m'][0]} -> "
            f"{r['load_average_1m'][1]}"
            + (f"; each figure the median of {r['rounds']} rounds" if r["rounds"] > 1 else "")
        ),
        (
            f"{'':21} {'plans (per rank-plan: CPU us)':-^66}  {'reports (per report)':-^48}"
            f"  {'engine':>7}"
        ),
        (
            f"{'clients':>7} {'batch':>5} {'way':>7} {'plans/s':>8} {'x b1':>5} {'calls/s':>7} "
            f"{'p50 ms':>7} {'p99 ms':>7} {'broker':>6} {'client':>6}   "
            f"{'reports/s':>9} {'x b1':>5} {'p99 ms':>7} {'broker':>6} {'client':>6}   "
            f"{'us/req':>7}"
        ),
    ]
    for p in r["phases"]:
        mark = "*" if p["batch"] == batch else " "
        lines.append(
            f"{p['clients']:>7} {p['batch']:>4}{mark} {p['way']:>7} {p['plan_per_s']:>8,.0f} "
            f"{p.get('plan_speedup', 0):>5.2f} {p['plan_calls_per_s']:>7,.0f} "
            f"{p['plan_p50_ms']:>7.2f} {p['plan_p99_ms']:>7.2f} {p['plan_broker_cpu_us']:>6.0f} "
            f"{p['plan_client_cpu_us']:>6.0f}   {p['report_per_s']:>9,.0f} "
            f"{p.get('report_speedup', 0):>5.2f} {p['report_p99_ms']:>7.2f} "
            f"{p['report_broker_cpu_us']:>6.0f} {p['report_client_cpu_us']:>6.0f}   "
            f"{p['engine_cpu_us_per_request']:>7.0f}"
            + (" (ran out of transfers)" if p["ran_out"] else "")
        )
    lines.append(
        f"batch: (transfer, rank) entries per call, 1 = GetTransferPlan/ReportTransfer; "
        f"* = {batch // r['decode_tp']} transfers x TP{r['decode_tp']} per call; x b1: "
        f"throughput against batch 1 at the same clients; engine us/req: decode engine CPU "
        f"per request, all {r['decode_tp']} ranks, plans (checked) + reports; way: calls = "
        f"unary calls, session = exchanges on one EngineSession stream per client"
    )
    for p in r["phases"]:
        if "session_vs_calls" in p:
            v = p["session_vs_calls"]
            lines.append(
                f"session / calls, {p['clients']} clients, batch {p['batch']}: rank-plans/s "
                f"{v['plan_per_s']:.2f}x, plan p99 {v['plan_p99_ms']:.2f}x, CPU per rank-plan "
                f"broker {v['plan_broker_cpu_us']:.2f}x client {v['plan_client_cpu_us']:.2f}x, "
                f"per report broker {v['report_broker_cpu_us']:.2f}x client "
                f"{v['report_client_cpu_us']:.2f}x, engine us/req "
                f"{v['engine_cpu_us_per_request']:.2f}x"
            )
    for f in r["floors"]:
        lines.append(
            f"floor (ListEngines, {f['clients']} clients): {f['per_s']:,.0f} calls/s, "
            f"p99 {f['p99_ms']:.2f} ms, broker {f['broker_cpu_us']:.0f} us per call"
        )
    if r["vllm_decode_us_per_request"]:
        lines.append(
            f"vLLM's own decode-side work per request: {r['vllm_decode_us_per_request']} us "
            f"({r['vllm_scope']})"
        )
    for way, fc in r["first_contact"].items():
        lines.append(
            f"first contact, {way.replace('_', ' ')} (new decode engine, "
            f"{r['decode_tp']} ranks registered -> every rank's first plan): median "
            f"{fc['median_ms']} ms (registered after {fc['registered_median_ms']} ms), "
            f"p90 {fc['p90_ms']} ms, max {fc['max_ms']} ms over {fc['pairs']} pairs"
        )
    counted = r["calls_per_transfer"]
    if counted:
        ways = []
        for way, c in counted.items():
            if isinstance(c, dict):
                calls = ", ".join(f"{n} {method}" for method, n in c["calls"].items())
                ways.append(
                    f"{way.replace('_', ' ')}: {c['per_transfer']:g} ({calls} for "
                    f"{c['transfers']} transfer{'s' if c['transfers'] > 1 else ''})"
                )
        lines.append(
            f"calls per transfer at TP{counted['prefill_tp']} -> TP{counted['decode_tp']}: "
            + "; ".join(ways)
        )
    lines.append("targets:")
    for t in r["targets"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        way = f" ({t['way']})" if t["way"] else ""
        lines.append(f"  {verdict:>12}: {t['target']} {t['goal']}: {t['measured']}{way}")
    return "\n".join(lines)


def _plot_control_plane(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from harness.control_plane_bench import TARGET_P99_MS, TARGET_RANK_PLANS_PER_S

    fig, (rate, latency) = plt.subplots(1, 2, figsize=(11, 4.5))
    batches = sorted({p["batch"] for p in r["phases"]})
    ways = sorted({p["way"] for p in r["phases"] if p["batch"] > 1}) or ["calls"]
    for n, way in ((n, w) for n in sorted({p["clients"] for p in r["phases"]}) for w in ways):
        phases = [
            p for p in r["phases"] if p["clients"] == n and (p["way"] == way or p["batch"] == 1)
        ]
        x = [p["batch"] for p in phases]
        label = f"{n} clients, {way}"
        (line,) = rate.plot(
            x, [p["plan_per_s"] for p in phases], "-o", ms=3, label=f"plans, {label}"
        )
        rate.plot(
            x,
            [p["report_per_s"] for p in phases],
            "--o",
            ms=3,
            color=line.get_color(),
            label=f"reports, {label}",
        )
        latency.plot(
            x,
            [p["plan_p99_ms"] for p in phases],
            "-o",
            ms=3,
            color=line.get_color(),
            label=f"plan p99, {label}",
        )
        latency.plot(
            x,
            [p["plan_p50_ms"] for p in phases],
            ":o",
            ms=3,
            color=line.get_color(),
            label=f"plan p50, {label}",
        )
    rate.axhline(TARGET_RANK_PLANS_PER_S, color="red", lw=0.8, ls=":", label="target")
    latency.axhline(TARGET_P99_MS, color="red", lw=0.8, ls=":", label="target p99")
    for axis in (rate, latency):
        axis.set_xscale("log", base=2)
        axis.set_xticks(batches, [str(b) for b in batches])
        axis.set_xlabel("(transfer, rank) entries per call (1: unary calls)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    rate.set_ylabel("rank-plans (reports) per second")
    rate.set_ylim(bottom=0)
    latency.set_ylabel("latency per call at the client (ms)")
    latency.set_yscale("log")
    latency.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
    latency.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    latency.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    title = f"{r['model']} {r['tokens'] // 1024}k TP{r['prefill_tp']}->TP{r['decode_tp']}"
    rate.set_title(f"Throughput, {title}, {r['cpus']} CPUs")
    latency.set_title("Latency")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
