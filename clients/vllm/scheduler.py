"""The connector's scheduler half: publishes finished prefill requests, plans decode loads.

Prefill engine (``kv_producer``): a request the proxy marked ``do_remote_decode`` runs all but
the last :meth:`SchedulerHalf.backoff` prompt tokens (one for Mamba models: decode needs the
state after N-1 tokens to compute token N itself) and one output token. When it finishes,
:meth:`SchedulerHalf.request_finished` publishes its blocks (transfer groups only; the Mamba
groups' running-state block) to the broker, keeps them until the workers report the broker's
release, and returns ``kv_transfer_params`` with only the transfer id and broker address.

Decode engine (``kv_consumer``): :meth:`get_num_new_matched_tokens` offers the published
tokens, :meth:`update_state_after_alloc` records the blocks vLLM allocated for them, and
:meth:`build_connector_meta` hands the loads to the workers. A request that will never load
(finished before its load, or a full local prefix-cache hit) has its transfer aborted so the
prefill engine frees the blocks at once rather than at expiry. While a request waits in
vLLM's queue (from :meth:`on_new_request`, which vLLM calls for every request it admits, even
those queued behind others that the scheduler never shows the connector, until its load
starts, it finishes or is aborted), its publication is kept alive: every step checks whether
the engine's waiting transfers are due and renews them all in one ``ExtendTransfers`` call
(:meth:`SchedulerHalf._keep_waiting_alive`), so a busy engine does not let them expire and
recompute whole prompts.

With ``batch_calls`` (the default) the decode scheduler also plans and reports for its
workers, one broker call each per step (:mod:`clients.vllm.batch`): a load whose reads the
broker did not record intact reaches vLLM as failed one step later and is recomputed.

Broker calls from the scheduler process go through the same client code as the workers'
(:mod:`clients.protocol` on a :class:`~clients.session.LoopThread`): a
:class:`~clients.protocol.FailoverStub` over the ``broker`` addresses, a publish whose reply
was lost with its replica reconciled. A publish, a step's plans and a step's reports block the
scheduler thread (their answers decide the step) for at most ``call_timeout_s``; aborts and
renewals are fire and forget (a renewal's answer is read on a later step, on the scheduler
thread).
"""

from __future__ import annotations

import concurrent.futures
import logging
import secrets
import time
from collections.abc import Sequence
from itertools import dropwhile
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    iter_layer_specs,
)
from vllm.v1.request import RequestStatus

from broker import tracing
from broker.layout import window_tail
from broker.limits import LIMITS
from broker.v1 import broker_pb2 as pb
from clients import protocol
from clients.protocol import BrokerCallError, FailoverStub
from clients.session import LoopThread
from clients.vllm.batch import BatchedCalls
from clients.vllm.metadata import (
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    ConnectorSettings,
    LoadSpec,
    PdBrokerMetadata,
    decode_params,
    pending_transfer,
)
from clients.vllm.stats import PdBrokerKVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
#: Marks a prefill-leg request whose prompt was already cut short (preemption re-runs it).
_TRUNCATED = "_pdbroker_truncated"
#: vLLM's null block (``BlockPool.null_block``: the first block, a placeholder for skipped and
#: padding blocks, shared by every request).
_NULL_BLOCK = 0
_PUBLISHABLE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
#: The broker's default publication TTL (ms): what renewals assume until it reports one.
_BROKER_DEFAULT_TTL_MS = 30_000
#: A renewal's outcome per waiting request: the broker's answer, or why it refused it.
Renewed = list[tuple[str, "pb.TransferExtension | BrokerCallError"]]


class SchedulerHalf:
    """Scheduler-side state of one engine; called from vLLM's scheduler thread only."""

    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: ConnectorSettings
    ) -> None:
        kv_config = vllm_config.kv_transfer_config
        assert kv_config is not None and kv_config.engine_id is not None
        self.engine_id = kv_config.engine_id
        self.settings = settings
        self.kv_cache_config = kv_cache_config
        self.backoff = max(
            1 if kv_cache_config.has_mamba_layers else 0,
            vllm_config.num_prefill_lookahead_tokens - 1,
        )
        #: Per transfer group: speculative scratch blocks trailing a Mamba group's state block
        #: (None for attention groups).
        self._scratch = [_scratch_blocks(g.kv_cache_spec) for g in kv_cache_config.transfer_groups]
        #: Per transfer group: a sliding-window group's (window tokens, block size), else None.
        self._windows = [_window(g.kv_cache_spec) for g in kv_cache_config.transfer_groups]
        self._loads: dict[str, LoadSpec] = {}
        self._sends: dict[str, str] = {}
        #: Requests of :attr:`_loads` whose plans this scheduler asks for (``batch_calls``).
        self._to_plan: set[str] = set()
        self._loop: LoopThread | None = None
        self._stub: FailoverStub | None = None
        self._aborts: set[concurrent.futures.Future[None]] = set()  # not finished yet
        #: Decode-leg requests waiting to load: request id -> (transfer id, prefill engine).
        self._waiting: dict[str, tuple[str, str]] = {}
        self._renewal: concurrent.futures.Future[Renewed] | None = None  # in flight
        self._renewed_at = -float("inf")  # time.monotonic() when the last one started
        #: The shortest TTL (ms) the broker reported for the waiting transfers.
        self._ttl_ms = settings.publish_ttl_ms or _BROKER_DEFAULT_TTL_MS
        self.calls = BatchedCalls(
            self.engine_id,
            vllm_config.parallel_config.tensor_parallel_size,
            settings.call_timeout_s,
            self._broker,
        )

    # ---------------------------------------------------------------- prefill leg

    def on_new_request(self, request: Request) -> None:
        """Keep a decode-leg request's publication alive until its load starts; cut a
        prefill-leg prompt short by :attr:`backoff` tokens and let it emit one token."""
        params = request.kv_transfer_params
        pending = pending_transfer(params)
        if pending is not None:
            self._waiting[request.request_id] = (pending.transfer_id, pending.prefill_engine)
        if (
            not params
            or not params.get(DO_REMOTE_DECODE)
            or params.get(_TRUNCATED)
            or not self.backoff
            or request.num_prompt_tokens <= self.backoff
            or request.get_skip_reading_prefix_cache()
        ):
            return
        if request.prompt_token_ids is not None:
            del request.prompt_token_ids[-self.backoff :]
        elif request.prompt_embeds is not None:
            request.prompt_embeds = request.prompt_embeds[: -self.backoff]
        else:
            return
        del request._all_token_ids[-self.backoff :]
        request.num_prompt_tokens -= self.backoff
        request.max_tokens = 1
        params[_TRUNCATED] = True

    def request_finished(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Prefill leg finished normally: publish and keep the blocks until released. Decode
        leg that never loaded: abort its transfer. Returns vLLM's ``(delay_free, params)``."""
        params = request.kv_transfer_params
        pending = pending_transfer(params)
        self._waiting.pop(request.request_id, None)
        if pending is not None:
            assert params is not None
            params[DO_REMOTE_PREFILL] = False
            self._abort(
                pending.transfer_id,
                pending.prefill_engine,
                f"decode request {request.request_id} finished before loading",
            )
            return False, None
        if not params or not params.get(DO_REMOTE_DECODE) or request.status not in _PUBLISHABLE:
            return False, None
        groups = self.transfer_blocks(block_ids)
        if request.num_computed_tokens <= 0 or not any(groups):
            return False, None
        transfer_id = f"{self.engine_id}:{request.request_id}:{secrets.token_hex(4)}"
        try:
            self._publish(transfer_id, groups, request.num_computed_tokens)
        except BrokerCallError as exc:
            log.warning(
                "cannot publish %s to the broker at %s (%s: %s); the decode engine will "
                "compute the prompt itself",
                request.request_id,
                self.settings.broker,
                exc.code.name,
                exc.details,
            )
            return False, None
        self._sends[transfer_id] = request.request_id
        return True, decode_params(
            transfer_id, self.settings.broker, self.engine_id, request.num_computed_tokens
        )

    def transfer_blocks(self, block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        """The transfer groups' block ids as the broker takes them: full-attention groups
        whole, sliding-window groups their in-window tail, Mamba groups only the
        running-state block (no speculative scratch, no null padding)."""
        return self._clip(
            self.kv_cache_config.select_transfer_block_ids([list(g) for g in block_ids])
        )

    def _clip(self, groups: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        """Keep a Mamba group's running-state block (vLLM's rule: its last block before the
        speculative scratch blocks) and a sliding-window group's last blocks (vLLM's
        ``get_exchange_clipped_blocks``: the window's blocks plus one) that are not the null
        block. vLLM pads a request's skipped out-of-window blocks with its null block (id 0)
        and the padding can reach into that tail (a prefill request's table keeps it;
        decode's unhashed ids leave it out). vLLM keeps it in the list and lets its worker
        trim prefill's list to decode's length; here it goes at once: the broker reads the
        lists as the request's tail, so a shorter list only starts later (still before the
        window's first token), never reads a page that holds no token of the request, never
        writes the null block every request shares, and never lists block 0 twice."""
        return tuple(
            _clip_group(list(g), scratch, window)
            for g, scratch, window in zip(groups, self._scratch, self._windows)
        )

    # ---------------------------------------------------------------- decode leg

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """The published tokens beyond what decode computed locally, loaded asynchronously."""
        if pending_transfer(request.kv_transfer_params) is None:
            return 0, False
        count = self._published_tokens(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Record the load into the blocks vLLM allocated (at most once per request)."""
        params = request.kv_transfer_params
        pending = pending_transfer(params)
        if pending is None:
            return
        self._waiting.pop(request.request_id, None)  # loads now (or never): renewed no more
        assert params is not None
        params[DO_REMOTE_PREFILL] = False
        if num_external_tokens <= 0:
            published = self._published_tokens(request)
            held = held_tokens(self.kv_cache_config, blocks)
            self._abort(
                pending.transfer_id,
                pending.prefill_engine,
                f"decode's prefix cache holds all {published} published tokens"
                if held >= published
                else f"decode computes past its own prefix-cache hit of {held} tokens",
                held_by_decode=held >= published,
            )
            return
        spec = LoadSpec(
            pending.transfer_id,
            pending.broker,
            self.transfer_blocks(blocks.get_unhashed_block_ids_all_groups()),
            self._published_tokens(request),
            pending.prefill_engine,
        )
        self._loads[request.request_id] = spec
        # Plans here only for what the broker will serve as this engine expects it; a
        # worker asking on its own checks the rest and fails the load, saying why.
        if (
            self.settings.batch_calls
            and pending.num_tokens == spec.num_tokens
            and spec.waits_at(self.settings.broker)
        ):
            self._to_plan.add(request.request_id)

    def _published_tokens(self, request: Request) -> int:
        """Tokens the prefill engine computed for this prompt (it held back :attr:`backoff`)."""
        n = request.num_prompt_tokens
        return n - self.backoff if n > self.backoff else n

    # ---------------------------------------------------------------- both

    def build_connector_meta(self) -> PdBrokerMetadata:
        """This step's loads (with their plans, :meth:`BatchedCalls.with_plans`), newly
        published transfers and loads to fail, handed over once; waiting transfers renewed
        when due."""
        self._keep_waiting_alive()
        meta = PdBrokerMetadata(
            loads=self.calls.with_plans(self._loads, self._to_plan)
            if self._to_plan
            else self._loads,
            sends=self._sends,
            failed_loads=self.calls.take_failed_loads(),
        )
        self._loads, self._sends, self._to_plan = {}, {}, set()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The workers' output of a step: their reports and finished loads
        (:meth:`BatchedCalls.update`)."""
        self.calls.update(output)

    def get_kv_connector_stats(self) -> PdBrokerKVConnectorStats | None:
        """The loads this scheduler planned whose reports were answered since the last call
        (None if none), which start anew."""
        stats = self.calls.stats
        return None if stats.is_empty() else stats.clone_and_reset()

    def shutdown(self) -> None:
        """Let pending aborts and renewals finish, close the broker channels, stop the loop
        thread."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        in_flight: list[concurrent.futures.Future[Any]] = [*self._aborts]
        if self._renewal is not None:
            in_flight.append(self._renewal)
        try:
            concurrent.futures.wait(in_flight)
            if self._stub is not None:
                loop.run(self._stub.close())
        finally:
            self._stub = None
            loop.close()

    # ---------------------------------------------------------------- broker calls

    def _broker(self) -> tuple[LoopThread, FailoverStub]:
        if self._loop is None or self._stub is None:
            self._loop = LoopThread(f"pdbroker-{self.engine_id}-scheduler")
            self._stub = FailoverStub(self.settings.broker, self.settings.channel_security())
        return self._loop, self._stub

    def _publish(
        self, transfer_id: str, block_ids: tuple[tuple[int, ...], ...], num_tokens: int
    ) -> None:
        loop, stub = self._broker()
        request = protocol.publication(
            transfer_id, self.engine_id, block_ids, num_tokens, ttl_ms=self.settings.publish_ttl_ms
        )
        with tracing.root_span(
            "prefill.publish",
            {
                "pdbroker.transfer_id": transfer_id,
                "pdbroker.prefill_engine": self.engine_id,
                "pdbroker.num_tokens": num_tokens,
            },
            rpc="PublishBlocks",
        ):
            loop.run(protocol.publish(stub, request, self.settings.call_timeout_s))

    def _keep_waiting_alive(self) -> None:
        """Read the last renewal's answer once it came; when renewals are due (at once for
        the first waiting request, then every ``extend_interval_s``: by default a third of
        the shortest TTL the broker reported) and none is in flight, start one for every
        waiting request (the broker's per-call limit at a time)."""
        if self._renewal is not None:
            if not self._renewal.done():
                return
            self._renewed(self._renewal)
            self._renewal = None
        now = time.monotonic()
        interval = self.settings.extend_interval_s or self._ttl_ms / 3000
        if not self._waiting or now < self._renewed_at + interval:
            return
        loop, stub = self._broker()
        waiting = list(self._waiting.items())

        async def renew() -> Renewed:
            outcomes: Renewed = []
            limit = LIMITS.max_extended_transfers
            for start in range(0, len(waiting), limit):
                batch = waiting[start : start + limit]
                answers = await protocol.extend(
                    stub, self.engine_id, [t for _, t in batch], self.settings.call_timeout_s
                )
                outcomes += zip([r for r, _ in batch], answers)
            return outcomes

        self._renewal = loop.submit(renew())
        self._renewed_at = now

    def _renewed(self, renewal: concurrent.futures.Future[Renewed]) -> None:
        """Learn the waiting transfers' TTL from a renewal's answer; stop renewing those the
        broker refused (ended, unknown, not this engine's: their loads fail and vLLM
        recomputes)."""
        try:
            outcomes = renewal.result()
        except Exception as exc:  # noqa: BLE001 - best effort: it never stops the scheduler
            log.warning(
                "cannot renew %d waiting transfers (%s); trying again when due",
                len(self._waiting),
                exc,
            )
            return
        ttls = [o.ttl_ms for _, o in outcomes if isinstance(o, pb.TransferExtension)]
        if ttls:
            self._ttl_ms = min(ttls)
        for request_id, outcome in outcomes:
            if isinstance(outcome, BrokerCallError):
                log.warning(
                    "transfer of request %s cannot be kept alive (%s: %s)",
                    request_id,
                    outcome.code.name,
                    outcome.details,
                )
                self._waiting.pop(request_id, None)

    def _abort(
        self, transfer_id: str, prefill_engine_id: str, reason: str, held_by_decode: bool = False
    ) -> None:
        """Tell the broker (in the background) that nobody will read ``transfer_id`` of
        ``prefill_engine_id`` ('' when the request did not name its prefill engine);
        ``held_by_decode``: because this engine's prefix cache holds it all."""
        loop, stub = self._broker()

        async def abort() -> None:
            try:
                await protocol.abort(
                    stub,
                    transfer_id,
                    reason,
                    self.settings.call_timeout_s,
                    prefill_engine_id,
                    held_by_decode,
                )
            except BrokerCallError as exc:
                log.warning(
                    "cannot abort transfer %s (%s: %s); it expires at the broker",
                    transfer_id,
                    exc.code.name,
                    exc.details,
                )

        future = loop.submit(abort())
        self._aborts.add(future)
        future.add_done_callback(self._aborts.discard)


def held_tokens(kv_cache_config: KVCacheConfig, blocks: KVCacheBlocks) -> int:
    """Prompt tokens a request takes from this engine's own prefix cache: the cached pages
    every attention group starts with (vLLM takes a Mamba state only where they end, and
    reconciles a deeper attention hit down to one it has a state for)."""
    return min(
        (
            sum(b.block_hash is not None and not b.is_null for b in group)
            * group_spec.kv_cache_spec.block_size
            for group, group_spec in zip(blocks.blocks, kv_cache_config.kv_cache_groups)
            if _scratch_blocks(group_spec.kv_cache_spec) is None
        ),
        default=0,
    )


def _clip_group(
    ids: list[int], scratch: int | None, window: tuple[int, int] | None
) -> tuple[int, ...]:
    """One transfer group's ids clipped as :meth:`SchedulerHalf._clip` says."""
    if scratch is not None:
        return tuple(clip_ssm_state_blocks(ids, scratch))
    if window is not None:
        tail = window_tail(ids, *window)
        return tuple(dropwhile(lambda block: block == _NULL_BLOCK, tail))
    return tuple(ids)


def _window(spec: KVCacheSpec) -> tuple[int, int] | None:
    """A sliding-window group's (window tokens, block size); None for other groups."""
    specs = list(iter_layer_specs(spec))
    if isinstance(specs[0], SlidingWindowSpec):
        return specs[0].sliding_window, specs[0].block_size
    return None


def _scratch_blocks(spec: KVCacheSpec) -> int | None:
    """Trailing speculative scratch blocks of a Mamba group (None for other groups)."""
    specs = list(iter_layer_specs(spec))
    return specs[0].num_speculative_blocks if isinstance(specs[0], MambaSpec) else None
