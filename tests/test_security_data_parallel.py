"""One identity for the data-parallel ranks vLLM derives from an engine id, against real
``pdbroker serve`` processes (client certificates and bearer tokens made as in
``test_security``).

vLLM names data-parallel rank ``N`` of an engine configured as ``X`` ``X_dpN``; a certificate
or token naming ``X`` acts for ``X`` and each ``X_dpN``, a publication allowing ``X`` admits
each ``X_dpN``, and nothing else is covered (``tests/test_identifiers.py`` holds the rule's
cases).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterator

import grpc
import pytest
from broker_helpers import register_request
from cryptography import x509
from test_security import (
    DENIED,
    NOT_FOUND,
    SCENARIO,
    WAIT_S,
    CertificateAuthority,
    Pki,
    expect,
    plan,
    publish,
    register,
    report,
    stub,
    tls_flags,
)

from broker.client_security import ChannelSecurity
from broker.v1 import broker_pb2 as pb
from harness.brokers import BrokerProcess

#: Deployments (what vLLM is configured with) and an operator.
CALLERS = ("prefill-0", "decode-0", "decode-1", "ops")
Credential = Callable[[str], ChannelSecurity]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority(directory, "test-ca")
    server = ca.issue(
        "broker",
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    clients = {caller: ca.issue(caller) for caller in CALLERS}
    clients["prefill-0"] = ca.issue("prefill", [x509.DNSName("prefill-0")])  # a SAN names it
    impostor = CertificateAuthority(directory, "other-ca").issue("decode-0")
    tokens = {caller: f"token-of-{caller}-0123456789abcdef" for caller in CALLERS}
    tokens_file = directory / "tokens"
    tokens_file.write_text("".join(f"{c}: {t}\n" for c, t in tokens.items()))
    return Pki(str(ca.cert_file), server, clients, impostor, str(tokens_file), tokens)


@pytest.fixture(params=["certificate", "token"])
def broker(request: pytest.FixtureRequest, pki: Pki) -> Iterator[tuple[str, Credential]]:
    """A broker identifying callers by client certificate or by bearer token, and how a
    caller proves its name to it."""
    if request.param == "certificate":
        flags, credential = ("--tls-client-ca", pki.ca), pki.mtls
    else:
        flags, credential = ("--auth-tokens", pki.tokens_file), pki.token
    process = BrokerProcess(
        *tls_flags(pki, *flags, "--admin-identities", "ops"), security=credential("ops")
    )
    yield process.address, credential
    process.stop()


def test_one_identity_acts_for_each_data_parallel_rank_of_its_engine(
    broker: tuple[str, Credential],
) -> None:
    address, credential = broker
    p, d, d1, ops = (stub(address, credential(c)) for c in CALLERS)
    for engine_id in (
        "decode-0_dp",
        "decode-0_dp01",
        "decode-0_dp1_dp2",
        "decode-0_dpa",
        "decode-0_dp1024",
        "decode-0y_dp0",
        "decode-1_dp0",
    ):
        request = register_request(SCENARIO.decode, engine_id, pb.ROLE_DECODE, 0)
        message = expect(d.RegisterRank, request, DENIED, "engine_id")
        assert repr(engine_id) in message
    register(p, "prefill-0_dp1", pb.ROLE_PREFILL, 0)
    leases = [register(d, f"decode-0_dp{n}", pb.ROLE_DECODE, 1 + n) for n in (0, 1)]
    register(d1, "decode-1_dp0", pb.ROLE_DECODE, 3)
    for lease in leases:
        assert d.KeepAlive(pb.KeepAliveRequest(lease_id=lease), timeout=WAIT_S).ttl_ms > 0
        expect(d1.KeepAlive, pb.KeepAliveRequest(lease_id=lease), DENIED, "lease_id")
    expect(d.PublishBlocks, publish("t1", "prefill-0_dp1"), DENIED, "engine_id")

    # Allowing a deployment admits each of its ranks; allowing one rank admits that one.
    for transfer_id, allowed in (("t1", "decode-0"), ("t2", "decode-0"), ("t3", "decode-0_dp0")):
        p.PublishBlocks(publish(transfer_id, "prefill-0_dp1", (allowed,)), timeout=WAIT_S)
    expect(d1.GetTransferPlan, plan("t1", "decode-0_dp1"), DENIED, "engine_id")
    for call, request in (
        (d1.GetTransferPlan, plan("t1", "decode-1_dp0")),
        (d1.GetTransfer, pb.GetTransferRequest(transfer_id="t1")),
        (d1.AbortTransfer, pb.AbortTransferRequest(transfer_id="t1")),
        (d.GetTransferPlan, plan("t3", "decode-0_dp1")),
    ):
        expect(call, request, NOT_FOUND, "transfer_id")
    unclaimed = d.GetTransfer(pb.GetTransferRequest(transfer_id="t1"), timeout=WAIT_S)
    assert unclaimed.state == pb.TRANSFER_STATE_PUBLISHED  # its ranks may read it
    for transfer_id, engine_id in (("t1", "decode-0_dp1"), ("t2", "decode-0_dp0")):
        ask = plan(transfer_id, engine_id)
        ask.prefill_engine_id = "prefill-0_dp1"  # as the vLLM connector names it
        plan_id = d.GetTransferPlan(ask, timeout=WAIT_S).plan_id
        expect(d1.ReportTransfer, report(plan_id, "decode-1_dp0"), DENIED, "plan_id")
        done = d.ReportTransfer(report(plan_id, engine_id), timeout=WAIT_S)
        assert done.state == pb.TRANSFER_STATE_COMPLETED and done.intact
        info = p.GetTransfer(pb.GetTransferRequest(transfer_id=transfer_id), timeout=WAIT_S)
        assert (info.prefill_engine_id, info.decode_engine_id) == ("prefill-0_dp1", engine_id)
    declined = d.AbortTransfer(pb.AbortTransferRequest(transfer_id="t3"), timeout=WAIT_S)
    assert declined.state == pb.TRANSFER_STATE_ABORTED  # decode-0_dp0 may read it

    engines = ops.ListEngines(pb.ListEnginesRequest(), timeout=WAIT_S).engines
    assert [e.engine_id for e in engines] == [
        "decode-0_dp0",
        "decode-0_dp1",
        "decode-1_dp0",
        "prefill-0_dp1",
    ]


def test_the_rank_quota_counts_every_data_parallel_rank_of_an_identity(pki: Pki) -> None:
    process = BrokerProcess(
        *tls_flags(pki, "--auth-tokens", pki.tokens_file, "--max-ranks-per-identity", "2")
    )
    try:
        d, d1 = (stub(process.address, pki.token(c)) for c in ("decode-0", "decode-1"))
        register(d, "decode-0_dp0", pb.ROLE_DECODE, 0)
        register(d, "decode-0_dp1", pb.ROLE_DECODE, 1)
        register(d, "decode-0_dp1", pb.ROLE_DECODE, 1)  # the same rank again
        for engine_id in ("decode-0_dp2", "decode-0"):
            request = register_request(SCENARIO.decode, engine_id, pb.ROLE_DECODE, 0, 2)
            message = expect(d.RegisterRank, request, grpc.StatusCode.RESOURCE_EXHAUSTED, "tp_rank")
            assert "holds 2 registered ranks" in message
        register(d1, "decode-1_dp0", pb.ROLE_DECODE, 3)
    finally:
        process.stop()
