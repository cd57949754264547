"""What crosses process boundaries: the ``kv_transfer_params`` a request carries from the
prefill engine to the decode engine, the connector settings, and the per-step metadata the
scheduler half hands the worker half.

``kv_transfer_params`` keep vLLM's own P/D flags (``do_remote_decode`` on the prefill leg, set
by the proxy; ``do_remote_prefill`` on the decode leg, which vLLM's serving layer and metrics
read) and add only the transfer id, the broker address, the publishing prefill engine (which
decode holds the broker to) and the published token count (which decode's scheduler checks
before it asks for plans): block ids, ranks and layouts stay with the broker.

Scheduler to workers, each step (:class:`PdBrokerMetadata`, pickled to every worker): the loads
to start, with every decode rank's plan when the scheduler asked the broker for them in one
``GetTransferPlans`` call (serialized ``GetTransferPlanResponse`` messages), the published
transfers, and the loads to report failed. Workers to scheduler
(:class:`PdBrokerWorkerMetadata`, merged over the TP ranks by vLLM's ``KVOutputAggregator``):
the reports of the plans the workers read, which the scheduler sends in one
``ReportTransfers`` call per step once every rank finished their load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from broker.client_security import ChannelSecurity
from clients.fetches import PlanReport
from clients.protocol import broker_addresses

#: Set by the proxy on the prefill leg: run the prompt here, keep the state for a decode engine.
DO_REMOTE_DECODE = "do_remote_decode"
#: Set on the decode leg: the prompt's state waits at the broker under :data:`TRANSFER_ID`.
DO_REMOTE_PREFILL = "do_remote_prefill"
TRANSFER_ID = "pdbroker_transfer_id"
BROKER = "pdbroker_broker"
PREFILL_ENGINE = "pdbroker_prefill_engine"
NUM_TOKENS = "pdbroker_num_tokens"


def decode_params(
    transfer_id: str, broker: str, prefill_engine: str, num_tokens: int
) -> dict[str, Any]:
    """The ``kv_transfer_params`` a finished prefill request hands the decode leg."""
    return {
        DO_REMOTE_PREFILL: True,
        TRANSFER_ID: transfer_id,
        BROKER: broker,
        PREFILL_ENGINE: prefill_engine,
        NUM_TOKENS: num_tokens,
    }


@dataclass(frozen=True)
class PendingTransfer:
    """A decode-leg request's state waiting at ``broker`` under ``transfer_id``, published by
    ``prefill_engine`` ('' when the parameters do not say) with ``num_tokens`` tokens (0 when
    they do not say)."""

    transfer_id: str
    broker: str
    prefill_engine: str = ""
    num_tokens: int = 0


def pending_transfer(params: Mapping[str, Any] | None) -> PendingTransfer | None:
    """The transfer of a decode-leg request whose state was not claimed yet."""
    if not params or not params.get(DO_REMOTE_PREFILL):
        return None
    transfer_id, broker = params.get(TRANSFER_ID), params.get(BROKER)
    if not isinstance(transfer_id, str) or not isinstance(broker, str) or not transfer_id:
        return None
    prefill_engine = params.get(PREFILL_ENGINE)
    num_tokens = params.get(NUM_TOKENS)
    return PendingTransfer(
        transfer_id,
        broker,
        prefill_engine if isinstance(prefill_engine, str) else "",
        num_tokens if type(num_tokens) is int and num_tokens > 0 else 0,
    )


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` of the connector. Durations in seconds, TTL in ms.

    ``broker``: ``HOST:PORT`` of ``pdbroker serve`` (required), or of replicas sharing a
    store, comma-separated (calls fail over between them). ``publish_ttl_ms``: how long a
    published request's blocks wait for a decode engine (0: the broker's default).
    ``model_name``: what prefill and decode engines of one model both call it (default: the
    served model name), prefixed to the layout digest in the model fingerprint.
    ``progress_interval_s``: how often a prefill rank polls its NIXL agent (readers' wire-up
    and their notifications need it). ``extend_interval_s``: how often a decode engine renews
    the publications its queued requests wait for, all in one call (0: a third of the
    shortest TTL the broker reports for them, so each is renewed twice before it could
    expire; the first renewal goes at once). ``tls_ca``, ``tls_cert``, ``tls_key``, ``token_file``:
    the broker connection's :class:`~broker.client_security.ChannelSecurity` (files; plaintext when
    ``tls_ca`` is empty); a client certificate or token must name the engine's ``engine_id``
    as configured: vLLM's data-parallel ranks run as ``engine_id_dp<N>``, which that name
    covers, so one credential serves every DP rank.
    ``backends`` and ``num_threads`` mean what they mean to vLLM's ``NixlConnector``: the NIXL
    backends of each rank's agent (e.g. ``["LIBFABRIC"]`` on AWS EFA), and the UCX backend's
    worker threads, applied when ``backends`` is ``["UCX"]`` (0: NIXL's default).
    ``batch_calls``: a decode engine's scheduler asks for every rank's plan of every load it
    starts in a step in one ``GetTransferPlans`` call and reports the loads every rank
    finished in a step in one ``ReportTransfers`` call; false: each worker asks for its own
    rank's plan and reports it (a ``GetTransfer``, ``GetTransferPlan`` and ``ReportTransfer``
    call per rank per request).
    """

    broker: str
    publish_ttl_ms: int = 0
    call_timeout_s: float = 10.0
    read_timeout_s: float = 30.0
    progress_interval_s: float = 0.001
    extend_interval_s: float = 0.0
    model_name: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    token_file: str = ""
    backends: tuple[str, ...] = ("UCX",)
    num_threads: int = 0
    batch_calls: bool = True

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        """Parse ``kv_connector_extra_config``; unknown keys are an error (typos)."""
        known = {f.name: f for f in fields(cls)}
        unknown = set(extra) - set(known)
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown keys {sorted(unknown)}; known: {sorted(known)}"
            )
        broker = extra.get("broker")
        if (
            not isinstance(broker, str)
            or not broker.strip(", ")
            or not all(":" in a for a in broker_addresses(broker))
        ):
            raise ValueError(
                'kv_connector_extra_config.broker: required, "HOST:PORT" of the broker '
                '(or "HOST:PORT,HOST:PORT" of replicas sharing a store)'
            )
        backends = extra.get("backends", ["UCX"])
        if (
            not isinstance(backends, list | tuple)
            or not backends
            or not all(isinstance(b, str) and b for b in backends)
            or len(set(backends)) != len(backends)
        ):
            raise ValueError(
                "kv_connector_extra_config.backends: a list of distinct NIXL backend names, "
                f'e.g. ["UCX"] or ["LIBFABRIC"], not {backends!r}'
            )
        # Every other field has a default whose type the value is converted to.
        values: dict[str, Any] = {}
        for name, value in extra.items():
            default = known[name].default
            try:
                values[name] = (
                    value
                    if default is MISSING
                    else _flag(value)
                    if isinstance(default, bool)
                    else type(default)(value)
                )
            except (TypeError, ValueError):
                raise ValueError(
                    f"kv_connector_extra_config.{name}: {value!r} is not a {type(default).__name__}"
                ) from None
        if values.get("num_threads", 0) < 0:
            raise ValueError("kv_connector_extra_config.num_threads: must be 0 or more")
        settings = cls(**values)
        settings.channel_security()  # a bad combination or unreadable token fails at start-up
        return settings

    def nixl_params(self) -> dict[str, str] | None:
        """Parameters of the NIXL backends (None: NIXL's defaults)."""
        if self.num_threads and self.backends == ("UCX",):
            return {"num_threads": str(self.num_threads)}
        return None

    def channel_security(self) -> ChannelSecurity:
        """How this engine connects to the broker; ``ValueError`` names the bad key."""
        try:
            return ChannelSecurity.from_files(
                self.tls_ca, self.tls_cert, self.tls_key, self.token_file
            )
        except ValueError as exc:
            raise ValueError(f"kv_connector_extra_config: {exc}") from None


def _flag(value: Any) -> bool:
    """A boolean setting: JSON ``true``/``false``, or those words as a string."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(value)


@dataclass(frozen=True)
class LoadSpec:
    """Decode: move ``transfer_id``'s state (``num_tokens`` tokens, published by
    ``prefill_engine``, '' for any) into ``block_ids`` (per transfer group) of this engine.
    ``plans``: per decode rank, the serialized ``GetTransferPlanResponse`` the scheduler
    received for it (b'' where the broker refused that rank's entry); empty when the
    scheduler asked for none. A rank without a plan asks for its own."""

    transfer_id: str
    broker: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    prefill_engine: str = ""
    plans: tuple[bytes, ...] = ()

    def waits_at(self, broker: str) -> bool:
        """Whether the transfer waits at ``broker`` (the same addresses, in any order)."""
        return set(broker_addresses(self.broker)) == set(broker_addresses(broker))

    def plan_of(self, tp_rank: int) -> bytes:
        """Decode rank ``tp_rank``'s serialized plan, b'' when it has none."""
        return self.plans[tp_rank] if tp_rank < len(self.plans) else b""


@dataclass
class PdBrokerMetadata(KVConnectorMetadata):
    """One scheduler step's orders to every worker: ``loads`` to start (by request id);
    ``sends``: transfers published for finished prefill requests (transfer id -> request id),
    whose releases the workers report as finished sends; ``failed_loads``: requests whose
    loads every worker finished but whose reads the broker did not record intact, which the
    workers now report as failed receives (vLLM recomputes them)."""

    loads: dict[str, LoadSpec] = field(default_factory=dict)
    sends: dict[str, str] = field(default_factory=dict)
    failed_loads: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class PdBrokerWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's reports of the plans workers read, each with its request id, for the
    scheduler half to send; vLLM merges every TP rank's (:meth:`aggregate`)."""

    reports: tuple[tuple[str, PlanReport], ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> PdBrokerWorkerMetadata:
        assert isinstance(other, PdBrokerWorkerMetadata)
        return PdBrokerWorkerMetadata(self.reports + other.reports)
