"""vLLM 0.33's own NIXL connector (pull mode) driven on CPU: its decode-side work for one
request, the side-by-side figure of ``pdbroker bench planner``.

For a scenario (:class:`harness.scenarios.Scenario`: model, TP sizes, block ids of one request)
:class:`VllmDecodeSide` builds, from vLLM's own objects (:mod:`harness.vllm.cpu_engine`), the
decode engine's rank 0 and the prefill ranks it reads from as ``NixlPullConnectorWorker``
objects registering CPU caches shaped as vLLM allocates them for that model and TP size
(FlashAttention pages, or FlashInfer's 16-token kernel blocks). vLLM's code runs unchanged;
the stand-ins are:

- NIXL's agent (``nixl_wrapper``) is a :class:`RecordingAgent`: every call into NIXL's C++
  library (``register_memory``, ``prep_xfer_dlist``, ``add_remote_agent``,
  ``make_prepped_xfer``, ``transfer``, ...) is recorded and returns a handle;
- the model's layers are :class:`_Layer` entries in the static forward context: each layer's
  attention backend and KV-cache spec, what vLLM's model layers register when instantiated;
- the TP rank and world size vLLM's parallel state reports are set while a worker is built
  (no N-process world), and the CPU affinity vLLM's CPU worker sets for itself is undone.

The first request goes through vLLM's handshake as in serving: the decode worker fetches the
prefill workers' metadata over vLLM's ZMQ side channel (the prefill scheduler's listener) and
loads it (``add_remote_agent``). :meth:`VllmDecodeSide.sample` then hands ``start_load_kv``
fresh metadata for the request, as vLLM's scheduler builds it, and times from that call to
vLLM's last ``make_prepped_xfer`` call.
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

# vLLM logs to stdout by default; keep stdout for the benchmark's table or JSON.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

# cpu_engine first: it configures vLLM for CPU before vLLM is imported.
from harness.vllm.cpu_engine import (
    MAMBA_TYPES,
    allocate,
    kv_cache_config,
    layer_specs,
    vllm_config,
    write_model,
)

# isort: split

import torch
from vllm.config import KVTransferConfig, VllmConfig, set_current_vllm_config
from vllm.config.kv_transfer import KVRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.flashinfer import FlashInferBackend
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
from vllm.v1.attention.selector import get_mamba_attn_backend
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec, MambaSpec

from broker.layout import EngineLayout
from harness.scenarios import Scenario
from harness.vllm import deepseek_v4

PREFILL_ID, DECODE_ID = "prefill", "decode"
HOST = "127.0.0.1"
#: Seconds one attempt at the first handshake may take: well under a second once vLLM's lazy
#: modules are loaded, tens of seconds from a cold disk after a fresh install.
HANDSHAKE_TIMEOUT_S = 90.0
#: Attempts, each with fresh workers and a fresh side-channel port: a fresh machine has seen a
#: first handshake never finish.
HANDSHAKE_ATTEMPTS = 3


class HandshakeFailed(RuntimeError):
    """vLLM's decode worker did not finish its handshake with the prefill workers."""


def _thread_stacks() -> str:
    """Where every thread but the caller's is, for an error that says what hung."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}"
        for ident, frame in sys._current_frames().items()
        if ident != threading.get_ident()
    )


class RecordingAgent:
    """Stands in for NIXL's ``nixl_agent``: records each call as (method, ``perf_counter_ns``
    at entry, args) and returns a fresh handle (``get_agent_metadata``: the agent's name as
    bytes; ``add_remote_agent``: the remote agent's name). :attr:`dlists` keeps each
    ``prep_xfer_dlist`` handle's descriptors (rows of address, length, device, stride, count:
    ``count`` blocks of ``length`` bytes ``stride`` bytes apart)."""

    def __init__(self, name: str, config: Any = None) -> None:
        self.name = name
        self.calls: list[tuple[str, int, tuple[Any, ...]]] = []
        self.dlists: dict[int, np.ndarray] = {}
        self._handles = itertools.count(1)

    def __getattr__(self, method: str) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((method, time.perf_counter_ns(), args))
            if method == "get_agent_metadata":
                return self.name.encode()
            if method == "add_remote_agent":
                return args[0].decode()
            handle = next(self._handles)
            if method == "prep_xfer_dlist":
                self.dlists[handle] = np.asarray(args[1], dtype=np.int64).reshape(-1, 5)
            return handle

        return record


class _Layer(AttentionLayerBase):
    """What a model layer registers in vLLM's static forward context: its backend and spec."""

    def __init__(self, backend: type, spec: KVCacheSpec) -> None:
        self.backend, self.spec = backend, spec

    def get_attn_backend(self) -> type:
        return self.backend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return self.spec


@contextmanager
def _as_rank(tp_size: int, tp_rank: int) -> Iterator[None]:
    """Build a worker as TP rank ``tp_rank`` of ``tp_size``, with NIXL's agent recorded."""
    affinity = os.sched_getaffinity(0)
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(base_worker, "NixlWrapper", RecordingAgent))
        stack.enter_context(
            mock.patch.object(base_worker, "get_tensor_model_parallel_rank", lambda: tp_rank)
        )
        stack.enter_context(
            mock.patch.object(base_worker, "get_tensor_model_parallel_world_size", lambda: tp_size)
        )
        try:
            yield
        finally:
            # vLLM's CPU worker pins the process to one core per NUMA node for its transfers;
            # undone so that both planners are timed alike.
            os.sched_setaffinity(0, affinity)


class _Engine:
    """One engine's vLLM config and KV-cache config, with the model's layers registered."""

    def __init__(
        self,
        model_dir: Path,
        layout: EngineLayout,
        role: KVRole,
        engine_id: str,
        backend: type,
        cache_dtype: str,
    ) -> None:
        # The engine's block size: its attention groups' (DeepSeek-V4: the compressed
        # caches', the largest; its other caches' block sizes are fixed).
        block_size = max(g.block_size for g in layout.groups if g.is_attention)
        transfer = KVTransferConfig(
            kv_connector="NixlConnector", kv_role=role, engine_id=engine_id, kv_buffer_device="cpu"
        )
        self.config = vllm_config(
            model_dir,
            layout.tp_size,
            transfer,
            NixlConnector,
            backend,
            block_size=block_size,
            cache_dtype=cache_dtype,
        )
        self.engine_id, self.backend = engine_id, backend
        self.caches: dict[int, dict[str, torch.Tensor]] = {}
        self.workers: dict[int, NixlPullConnectorWorker] = {}
        specs = layer_specs(self.config, backend)
        backends = (
            deepseek_v4.layer_backends(self.config)
            if deepseek_v4.is_deepseek_v4(self.config)
            else {
                name: self._mamba_backend() if isinstance(spec, MambaSpec) else backend
                for name, spec in specs.items()
            }
        )
        self.config.compilation_config.static_forward_context.update(
            {name: _Layer(backends[name], spec) for name, spec in specs.items()}
        )
        self.kv_config: KVCacheConfig = kv_cache_config(
            self.config, layout.ranks[0].num_blocks, backend
        )
        groups = len(self.kv_config.kv_cache_groups)
        if self.config.cache_config.block_size != block_size or groups != len(layout.groups):
            raise ValueError(f"vLLM groups {engine_id}'s layers otherwise than the scenario")

    def _mamba_backend(self) -> type:
        return get_mamba_attn_backend(MAMBA_TYPES[self.config.model_config.hf_config.model_type])

    def worker(self, tp_rank: int) -> NixlPullConnectorWorker:
        """TP rank ``tp_rank``'s connector worker, its caches registered."""
        with (
            _as_rank(self.config.parallel_config.tensor_parallel_size, tp_rank),
            set_current_vllm_config(self.config),
        ):
            worker = NixlPullConnectorWorker(self.config, self.engine_id, self.kv_config)
            self.caches[tp_rank] = allocate(self.config, self.kv_config, self.backend)
            worker.register_kv_caches(self.caches[tp_rank])
        self.workers[tp_rank] = worker
        return worker

    def regions(self, tp_rank: int) -> list[tuple[int, int, set[str]]]:
        """The regions ``tp_rank``'s worker registered, in its order: (base address, bytes,
        the layers whose cache starts in it)."""
        worker = self.workers[tp_rank]
        bases = worker.kv_caches_base_addr[self.engine_id][tp_rank]
        sizes = [
            stride * blocks
            for stride, blocks in zip(
                worker.block_stride_per_layer, worker.region_num_blocks, strict=True
            )
        ]
        layers: list[set[str]] = [set() for _ in bases]
        for name, cache in self.caches[tp_rank].items():
            start = (cache[0] if isinstance(cache, (list, tuple)) else cache).data_ptr()
            for region, (base, size) in enumerate(zip(bases, sizes, strict=True)):
                if base <= start < base + size:
                    layers[region].add(name)
        return [(b, n, names) for b, n, names in zip(bases, sizes, layers, strict=True)]


def _expand(dlist: np.ndarray) -> np.ndarray:
    """(address, bytes) of each block of strided descriptor rows, in NIXL's index order."""
    starts = np.concatenate(
        [addr + stride * np.arange(count) for addr, _, _, stride, count in dlist]
    )
    return np.stack([starts, np.repeat(dlist[:, 1], dlist[:, 4])], axis=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class VllmDecodeSide:
    """vLLM's decode rank ``decode_rank`` of ``sc`` after its handshake with the prefill
    ranks it reads; ``preset`` names the model's ``config.json`` (or is one).
    ``kernel_block_size`` 0: FlashAttention (kernel block = logical block), else FlashInfer
    (which must choose that size); MLA: Triton MLA; ``cache_dtype``: vLLM's
    ``--kv-cache-dtype``. :attr:`handshake_s` is the first
    request's handshake (NIXL's C++ calls recorded, not run); :attr:`descriptors` what vLLM
    posts for the request; :meth:`reads` the descriptors themselves."""

    def __init__(
        self,
        preset: str | Mapping[str, Any],
        sc: Scenario,
        kernel_block_size: int = 0,
        decode_rank: int = 0,
        cache_dtype: str = "auto",
    ) -> None:
        backend: type = FlashInferBackend if kernel_block_size else FlashAttentionBackend
        if sc.model.attention is not None and sc.model.attention.latent:
            backend = TritonMLABackend
        self.sc, self.decode_rank, self._requests = sc, decode_rank, itertools.count()
        self._workers: list[NixlPullConnectorWorker] = []
        self._scheduler: NixlPullConnectorScheduler | None = None
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = write_model(preset, Path(tmp) / "model")
            decode = _Engine(model_dir, sc.decode, "kv_consumer", DECODE_ID, backend, cache_dtype)
            prefill = _Engine(
                model_dir, sc.prefill, "kv_producer", PREFILL_ID, backend, cache_dtype
            )
            self.decode_engine, self.prefill_engine = decode, prefill
            for attempt in range(1, HANDSHAKE_ATTEMPTS + 1):
                try:
                    self._start(decode, prefill, kernel_block_size)
                    break
                except HandshakeFailed as failure:
                    self.close()
                    if attempt == HANDSHAKE_ATTEMPTS:
                        raise
                    print(f"retrying vLLM's handshake: {failure}", file=sys.stderr)
                except BaseException:
                    self.close()
                    raise

    def _start(self, decode: _Engine, prefill: _Engine, kernel_block_size: int) -> None:
        """Build the workers, serve the prefill ranks' handshake, run the first request."""
        self.worker = decode.worker(self.decode_rank)
        self._workers.append(self.worker)
        if kernel_block_size and self.worker.block_size != kernel_block_size:
            raise ValueError(f"vLLM chose {self.worker.block_size}-token kernel blocks")
        assert self.worker.transfer_topo is not None
        payloads: dict[tuple[int, int], KVConnectorHandshakeMetadata] = {}
        for rank in self.worker.transfer_topo.handshake_target_ranks(self.sc.prefill.tp_size, 1):
            worker = prefill.worker(rank)
            self._workers.append(worker)
            assert worker.xfer_handshake_metadata is not None  # set by register_kv_caches
            payloads[(0, rank)] = worker.xfer_handshake_metadata
        self.port = _free_port()
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": HOST, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.port)}
        with mock.patch.dict(os.environ, env):
            self._scheduler = NixlPullConnectorScheduler(
                prefill.config, PREFILL_ID, prefill.kv_config
            )
        self._scheduler.set_xfer_handshake_metadata(payloads)
        self.handshake_s = self._first_request()
        self.descriptors = self._post()[1]

    def _metadata(self) -> NixlConnectorMetadata:
        """The connector metadata vLLM's scheduler hands the worker for a new request that
        loads ``sc``'s request (kv_transfer_params as the prefill engine returned them)."""
        n = next(self._requests)
        request = self.sc.request
        metadata = NixlConnectorMetadata()
        metadata.add_new_req_to_recv(
            request_id=f"decode-{n}",
            local_block_ids=tuple(list(g) for g in request.decode_block_ids),
            kv_transfer_params={
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": tuple(list(g) for g in request.prefill_block_ids),
                "remote_engine_id": PREFILL_ID,
                "remote_request_id": f"prefill-{n}",
                "remote_host": HOST,
                "remote_port": self.port,
                "tp_size": self.sc.prefill.tp_size,
                "dcp_size": 1,
                "pp_size": 1,
                "remote_num_tokens": request.num_tokens,
            },
            local_num_computed_blocks=(0,) * len(request.decode_block_ids),
            awaiting_kvs=True,
        )
        return metadata

    def _first_request(self) -> float:
        """Seconds from the first request's ``start_load_kv`` to its handshake done; the
        next step reads it."""
        start = time.perf_counter()
        self.worker.start_load_kv(self._metadata())
        while self.worker._ready_requests.empty():
            if not self.worker._failed_recv_reqs.empty():
                raise HandshakeFailed("vLLM's handshake failed (its log above says why)")
            if time.perf_counter() - start > HANDSHAKE_TIMEOUT_S:
                raise HandshakeFailed(
                    f"vLLM's handshake did not finish in {HANDSHAKE_TIMEOUT_S:.0f} s; "
                    f"where its threads were:\n{_thread_stacks()}"
                )
            time.sleep(1e-4)
        handshake_s = time.perf_counter() - start
        self.worker.start_load_kv(NixlConnectorMetadata())
        self._forget()
        return handshake_s

    def _forget(self) -> None:
        """Drop the worker's record of posted reads (the transfers never complete)."""
        self.worker._recving_transfers.clear()
        self.worker._recving_metadata.clear()

    def _posts(self) -> tuple[int, list[tuple[Any, ...]]]:
        """One new request through ``start_load_kv``: its start (``perf_counter_ns``) and the
        ``make_prepped_xfer`` calls vLLM made for it, each (entry time, args)."""
        metadata = self._metadata()
        agent = self.worker.nixl_wrapper
        agent.calls.clear()
        start = time.perf_counter_ns()
        self.worker.start_load_kv(metadata)
        posts = [(at, args) for method, at, args in agent.calls if method == "make_prepped_xfer"]
        self._forget()
        if not posts:
            raise RuntimeError("vLLM posted no read for the request")
        return start, posts

    def _post(self) -> tuple[int, int]:
        """Nanoseconds from a new request's ``start_load_kv`` to vLLM's last
        ``make_prepped_xfer`` call, and the descriptors it posted."""
        start, posts = self._posts()
        return posts[-1][0] - start, sum(len(args[2]) for _, args in posts)

    def reads(self) -> list[tuple[int, int, int, int]]:
        """Each descriptor vLLM posts for a new request: (local address, prefill rank, remote
        address, bytes)."""
        dlists = self.worker.nixl_wrapper.dlists
        ranks = {h: r for r, h in self.worker.dst_xfer_side_handles[PREFILL_ID].items()}
        reads = []
        for _, (_, local, local_ids, remote, remote_ids) in self._posts()[1]:
            local_descs, remote_descs = _expand(dlists[local]), _expand(dlists[remote])
            for i, j in zip(local_ids, remote_ids, strict=True):
                (addr, length), (remote_addr, remote_length) = local_descs[i], remote_descs[j]
                if length != remote_length:
                    raise RuntimeError(f"vLLM reads {remote_length} bytes into {length}")
                reads.append((int(addr), ranks[remote], int(remote_addr), int(length)))
        return reads

    def sample(self) -> int:
        """Nanoseconds vLLM's decode rank 0 takes from ``start_load_kv`` to its last
        ``make_prepped_xfer`` for a new request."""
        return self._post()[0]

    def close(self) -> None:
        for worker in self._workers:
            worker.shutdown()
        self._workers.clear()
        if self._scheduler is not None:
            self._scheduler.shutdown()
            self._scheduler = None
