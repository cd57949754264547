"""Data-parallel vLLM engines through a live broker, on CPU (the engines and checks of
``test_vllm_connector``).

With data parallelism each DP rank is an engine core of its own, configured as vLLM's engine
core configures it: ``data_parallel_rank`` set and ``kv_transfer_config.engine_id`` suffixed
``_dp<rank>`` (``vllm.v1.engine.utils._apply_dp_identity_suffix``). A prefill deployment of
two DP ranks publishes one request from each rank; a decode deployment of two DP ranks loads
one each, crosswise, so every plan must come from the publishing rank's own registration
(the other prefill rank's pages hold another request's bytes). With authentication, each
deployment proves one name, ``prefill-0`` or ``decode-0``, for all its ranks.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_vllm_connector import (
    NUM_BLOCKS,
    assert_transferred,
    decode,
    prefill,
    transfer_blocks,
)
from vllm_engines import (
    Engine,
    engine_config,
    vllm_distributed,  # noqa: F401 - an autouse fixture
    write_model,
)

# isort: split
# vllm_engines first: it configures vLLM for CPU and skips this module without vLLM.
from cryptography import x509
from test_security import CertificateAuthority
from vllm.v1.engine.utils import _apply_dp_identity_suffix

from broker.client_security import ChannelSecurity
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from clients.protocol import BrokerCallError
from clients.vllm.metadata import PREFILL_ENGINE, TRANSFER_ID
from harness.brokers import BrokerProcess

DP_SIZE = 2
#: Deployments as vLLM is configured with them, and the operator reading transfer states.
IDENTITIES = ("prefill-0", "decode-0", "ops")


class Deployment:
    """A broker and what each engine's ``kv_connector_extra_config`` needs to reach it as
    ``name``; ``security`` reads transfer states."""

    def __init__(
        self,
        broker: BrokerProcess,
        credentials: Callable[[str], dict[str, str]],
        security: ChannelSecurity,
    ) -> None:
        self.broker, self.credentials, self.security = broker, credentials, security

    def transfer_state(self, transfer_id: str, prefill_engine_id: str) -> str:
        with self.security.channel(self.broker.address) as channel:
            response = pb_grpc.BrokerStub(channel).GetTransfer(
                pb.GetTransferRequest(transfer_id=transfer_id, prefill_engine_id=prefill_engine_id),
                timeout=10,
            )
        return pb.TransferState.Name(response.state)


@pytest.fixture(params=["plaintext", "token", "certificate"])
def deployment(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Deployment]:
    if request.param == "plaintext":
        broker = BrokerProcess()
        yield Deployment(broker, lambda name: {}, ChannelSecurity())
        broker.stop()
        return
    ca = CertificateAuthority(tmp_path, "test-ca")
    server = ca.issue(
        "broker",
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    if request.param == "token":
        tokens = {name: f"token-of-{name}-0123456789abcdef" for name in IDENTITIES}
        (tmp_path / "tokens").write_text("".join(f"{n}: {t}\n" for n, t in tokens.items()))
        for name, token in tokens.items():
            (tmp_path / f"{name}.token").write_text(token)
        flags = ("--auth-tokens", str(tmp_path / "tokens"))

        def credentials(name: str) -> dict[str, str]:
            return {"tls_ca": str(ca.cert_file), "token_file": str(tmp_path / f"{name}.token")}
    else:
        certificates = {name: ca.issue(name) for name in IDENTITIES}
        flags = ("--tls-client-ca", str(ca.cert_file))

        def credentials(name: str) -> dict[str, str]:
            cert, key = certificates[name]
            return {"tls_ca": str(ca.cert_file), "tls_cert": cert, "tls_key": key}

    security = ChannelSecurity.from_files(**credentials("ops"))
    broker = BrokerProcess(
        "--tls-cert", server[0], "--tls-key", server[1], *flags,
        "--admin-identities", "ops", security=security,
    )  # fmt: skip
    yield Deployment(broker, credentials, security)
    broker.stop()


def data_parallel_rank(
    model: Path, role: str, engine_id: str, dp_rank: int, deployment: Deployment
) -> Engine:
    """DP rank ``dp_rank`` of the engine configured as ``engine_id``, configured as vLLM's
    engine core configures it."""
    extra: dict[str, Any] = {
        "broker": deployment.broker.address,
        "model_name": "test-model",
        **deployment.credentials(engine_id),
    }
    config = engine_config(model, 1, role=role, engine_id=engine_id, extra=extra)
    parallel = config.parallel_config
    parallel.data_parallel_size, parallel.data_parallel_rank = DP_SIZE, dp_rank
    parallel.data_parallel_index = dp_rank
    _apply_dp_identity_suffix(config, dp_rank)
    return Engine(config, NUM_BLOCKS, poison=role == "kv_consumer")


def test_data_parallel_ranks_publish_and_load_each_their_own_requests(
    deployment: Deployment, tmp_path: Path
) -> None:
    model = write_model("qwen3.5-0.8b", tmp_path / "m")
    producers: list[Engine] = []
    consumers: list[Engine] = []
    try:
        for rank in range(DP_SIZE):
            producers.append(
                data_parallel_rank(model, "kv_producer", "prefill-0", rank, deployment)
            )
            consumers.append(data_parallel_rank(model, "kv_consumer", "decode-0", rank, deployment))
        assert deployment.broker.list_engines() == (
            "decode-0_dp0",
            "decode-0_dp1",
            "prefill-0_dp0",
            "prefill-0_dp1",
        )
        free = [p.free_blocks for p in producers]
        # Request r<n> runs on prefill DP rank n and decode DP rank 1-n: the same block ids
        # on both prefill ranks, holding different bytes.
        prompts = {f"r{n}": list(range(1 + n, 1200 + n)) for n in range(DP_SIZE)}
        params = {r: prefill(producers[n], r, prompts[r]) for n, r in enumerate(prompts)}
        for n, (request_id, prompt) in enumerate(prompts.items()):
            producer, consumer = producers[n], consumers[DP_SIZE - 1 - n]
            sent = params[request_id]
            assert sent is not None and sent[PREFILL_ENGINE] == f"prefill-0_dp{n}"
            prefill_blocks = transfer_blocks(producer, request_id)
            seen = decode(consumer, request_id, prompt, sent, producer)
            assert seen["scheduled"] == [1, 1, 1]
            assert_transferred(
                producer,
                prefill_blocks,
                consumer,
                transfer_blocks(consumer, request_id, seen["blocks"]),
                len(prompt) - 1,
            )
            state = deployment.transfer_state(sent[TRANSFER_ID], sent[PREFILL_ENGINE])
            assert state == "TRANSFER_STATE_COMPLETED"
        assert [p.free_blocks for p in producers] == free  # releases freed every prefill block
    finally:
        for engine in consumers + producers:
            engine.close()


def test_a_data_parallel_rank_of_another_deployment_is_refused(tmp_path: Path) -> None:
    """``decode-0``'s certificate does not name ``decode-1_dp0``: the rank cannot register."""
    ca = CertificateAuthority(tmp_path, "test-ca")
    server = ca.issue("broker", [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert, key = ca.issue("decode-0")
    broker = BrokerProcess(
        "--tls-cert", server[0], "--tls-key", server[1], "--tls-client-ca", str(ca.cert_file),
        security=ChannelSecurity(str(ca.cert_file), cert, key),
    )  # fmt: skip
    impostor = Deployment(
        broker,
        lambda name: {"tls_ca": str(ca.cert_file), "tls_cert": cert, "tls_key": key},
        ChannelSecurity(),
    )
    try:
        model = write_model("qwen3.5-0.8b", tmp_path / "m")
        refusal = "RegisterRank: PERMISSION_DENIED: engine_id: caller decode-0 may not act "
        with pytest.raises(BrokerCallError, match=re.escape(f"{refusal}for engine 'decode-1_dp0'")):
            data_parallel_rank(model, "kv_consumer", "decode-1", 0, impostor)
    finally:
        broker.stop()
