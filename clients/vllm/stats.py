"""Decode-side transfer statistics in vLLM's ``KVConnectorStats`` form, and their Prometheus
metrics.

Per load of a decode rank: the NIXL read time (every source's READ, from posting to
completion), the broker's plan time (the rank's ``GetTransferPlan``, or the scheduler's
``GetTransferPlans`` call that asked for it), and the bytes and descriptors the plan moved;
per unusable load, whether the broker had ended its transfer (expired, aborted, or failed by
another decode rank: the prefill blocks were released) or the load failed otherwise. A worker
records the loads it planned itself; the scheduler half records those whose plans it asked
for, once the broker answered their reports. vLLM collects the workers' and the scheduler's
stats each step (``get_kv_connector_stats``), merges the workers' and the steps'
(:meth:`PdBrokerKVConnectorStats.aggregate`), logs :meth:`~PdBrokerKVConnectorStats.reduce`
periodically and feeds each step's payload to :class:`PdBrokerPromMetrics` (``/metrics``).

Metric names follow vLLM's NixlConnector (``vllm:nixl_*``) with ``pdbroker`` in place of
``nixl``: an observation is one rank's load, which may read from several prefill ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from prometheus_client import Counter, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from clients.fetches import RankFetch

#: Per successful load: seconds, seconds, bytes, descriptors.
SERIES = ("transfer_duration", "plan_duration", "bytes_transferred", "num_descriptors")
#: Per unusable load, one entry of 1.
COUNTS = ("num_failed_transfers", "num_expired_transfers")


@dataclass
class PdBrokerKVConnectorStats(KVConnectorStats):
    """One worker's (or, aggregated, several workers' and steps') observations: a list per
    key of :data:`SERIES` and :data:`COUNTS`, serializable as vLLM requires."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, list[float | int]] = {key: [] for key in (*SERIES, *COUNTS)}

    def record_transfer(self, fetch: RankFetch) -> None:
        """A load this rank read and the broker confirmed intact."""
        self.record_read(fetch.read_s, fetch.plan_s, fetch.nbytes, fetch.num_descriptors)

    def record_read(self, read_s: float, plan_s: float, nbytes: int, num_descriptors: int) -> None:
        """A rank's load the broker confirmed intact: its read and plan times, its plan's
        bytes and descriptors."""
        for key, value in zip(SERIES, (read_s, plan_s, nbytes, num_descriptors)):
            self.data[key].append(value)

    def record_failed_transfer(self) -> None:
        """A load that failed (broker unreachable, plan refused, read failed, ...)."""
        self.data["num_failed_transfers"].append(1)

    def record_expired_transfer(self) -> None:
        """A load whose transfer the broker had ended (expired, aborted, failed by another
        rank) before this rank's report."""
        self.data["num_expired_transfers"].append(1)

    def clone_and_reset(self) -> PdBrokerKVConnectorStats:
        old = copy.copy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not any(self.data[key] for key in (*SERIES, *COUNTS))

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, values in other.data.items():
            self.data[key].extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        """A summary of the interval for vLLM's log line; times and sizes cover the
        successful loads, failures are counted on every interval."""
        counts = {
            "Num failed transfers": len(self.data["num_failed_transfers"]),
            "Num expired transfers": len(self.data["num_expired_transfers"]),
        }
        n = self.num_successful_transfers
        if n == 0:
            return {"Num successful transfers": 0, **counts}
        read_s = np.asarray(self.data["transfer_duration"], dtype=np.float64)
        plan_s = np.asarray(self.data["plan_duration"], dtype=np.float64)
        mb = np.asarray(self.data["bytes_transferred"], dtype=np.float64) / 2**20
        descriptors = np.asarray(self.data["num_descriptors"], dtype=np.float64)
        return {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(float(read_s.mean()) * 1e3, 3),
            "P90 xfer time (ms)": round(float(np.percentile(read_s, 90)) * 1e3, 3),
            "Avg plan time (ms)": round(float(plan_s.mean()) * 1e3, 3),
            "P90 plan time (ms)": round(float(np.percentile(plan_s, 90)) * 1e3, 3),
            "Total MB": round(float(mb.sum()), 3),
            "Avg MB per transfer": round(float(mb.mean()), 3),
            "Throughput (MB/s)": round(float(mb.sum() / max(read_s.sum(), 1e-9)), 3),
            "Avg number of descriptors": round(float(descriptors.mean()), 1),
            **counts,
        }

    @property
    def num_successful_transfers(self) -> int:
        return len(self.data["transfer_duration"])


#: Seconds, from 1 ms (a loopback read) to 5 s.
_TIME_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
#: 2 KiB to 8 GiB, every factor of 4 (vLLM's NIXL buckets).
_BYTE_BUCKETS = [2 ** (10 + i) for i in range(1, 25, 2)]
_DESCRIPTOR_BUCKETS = [10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000]


class PdBrokerPromMetrics(KVConnectorPromMetrics):
    """``vllm:pdbroker_*`` histograms per successful load and counters of unusable ones,
    labelled per engine as vLLM's other metrics."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM types the metric classes it passes as their union.
        histogram_cls = cast("type[Histogram]", self._histogram_cls)
        counter_cls = cast("type[Counter]", self._counter_cls)
        histograms: tuple[tuple[str, str, Sequence[float]], ...] = (
            ("xfer_time_seconds", "NIXL read time of a decode rank's load", _TIME_BUCKETS),
            ("plan_time_seconds", "time to get a load's plan from pdbroker", _TIME_BUCKETS),
            ("bytes_transferred", "bytes a decode rank's load read", _BYTE_BUCKETS),
            ("num_descriptors", "NIXL descriptors of a decode rank's load", _DESCRIPTOR_BUCKETS),
        )
        counters = (
            ("num_failed_transfers", "decode loads that failed (their requests are recomputed)"),
            ("num_expired_transfers", "decode loads of a transfer the broker had already ended"),
        )
        self.histograms = {
            key: self._per_engine(
                histogram_cls(
                    name=f"vllm:pdbroker_{name}",
                    documentation=f"Histogram of the {doc}.",
                    buckets=buckets,
                    labelnames=labelnames,
                )
            )
            for key, (name, doc, buckets) in zip(SERIES, histograms)
        }
        self.counters = {
            key: self._per_engine(
                counter_cls(
                    name=f"vllm:pdbroker_{name}",
                    documentation=f"Number of {doc}.",
                    labelnames=labelnames,
                )
            )
            for key, (name, doc) in zip(COUNTS, counters)
        }

    def _per_engine(self, metric: PromMetric) -> dict[int, PromMetric]:
        return create_metric_per_engine(metric, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, histogram in self.histograms.items():
            for value in transfer_stats_data[key]:
                cast(Histogram, histogram[engine_idx]).observe(value)
        for key, counter in self.counters.items():
            if count := sum(transfer_stats_data[key]):
                cast(Counter, counter[engine_idx]).inc(count)
