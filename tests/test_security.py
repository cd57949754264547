"""TLS, mutual TLS, bearer tokens and authorization against real ``pdbroker serve`` processes.

A throwaway CA (``cryptography``) signs the broker's certificate (``localhost``,
``127.0.0.1``) and one client certificate per caller, whose common name is the caller's
name; a second CA signs an impostor. Each test asserts what the caller gets back: the
status code and the field the message names, and that the broker keeps serving others.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from broker_helpers import hybrid, register_request
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prerequisites import require_module
from prometheus_client.parser import text_string_to_metric_families

from broker.client_security import ChannelSecurity
from broker.layout import GroupKind
from broker.models import AttentionParams, ModelSpec
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from harness.brokers import BrokerProcess
from harness.fleet import PairSpec, run_fleet
from harness.scenarios import Scenario, build_scenario

WAIT_S = 10.0
#: Callers with a certificate and a token: two engines of each role and an operator.
CALLERS = ("P", "P2", "D", "D2", "ops")


# --------------------------------------------------------------------------- throwaway PKI


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class CertificateAuthority:
    """A CA whose certificate and issued certificates are PEM files in ``directory``."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.name = name
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.certificate = self._sign(_name(name), self.key.public_key(), ca=True)
        self.cert_file = directory / f"{name}.pem"
        self.cert_file.write_bytes(self.certificate.public_bytes(serialization.Encoding.PEM))

    def _sign(self, subject: x509.Name, public_key, ca: bool = False, sans=()) -> x509.Certificate:
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(_name(self.name))
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        return builder.sign(self.key, hashes.SHA256())

    def issue(self, common_name: str, sans=()) -> tuple[str, str]:
        """A certificate for ``common_name`` (and ``sans``): (cert file, key file)."""
        key = ec.generate_private_key(ec.SECP256R1())
        certificate = self._sign(_name(common_name), key.public_key(), sans=sans)
        stem = self.directory / f"{self.name}-{common_name}"
        cert_file, key_file = stem.with_suffix(".crt"), stem.with_suffix(".key")
        cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(_pem_key(key))
        return str(cert_file), str(key_file)


@dataclass
class Pki:
    ca: str
    server: tuple[str, str]
    clients: dict[str, tuple[str, str]]
    impostor: tuple[str, str]  # "D", signed by another CA
    tokens_file: str
    tokens: dict[str, str]

    def mtls(self, caller: str) -> ChannelSecurity:
        return ChannelSecurity(self.ca, *self.clients[caller])

    def token(self, caller: str) -> ChannelSecurity:
        return ChannelSecurity(self.ca, token=self.tokens[caller])


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
    clients["decode-0"] = ca.issue("decode-0")
    impostor = CertificateAuthority(directory, "other-ca").issue("D")
    tokens = {caller: f"token-of-{caller}-0123456789abcdef" for caller in CALLERS}
    tokens_file = directory / "tokens"
    tokens_file.write_text("# name: token\n" + "".join(f"{c}: {t}\n" for c, t in tokens.items()))
    return Pki(str(ca.cert_file), server, clients, impostor, str(tokens_file), tokens)


def tls_flags(pki: Pki, *more: str) -> tuple[str, ...]:
    return ("--tls-cert", pki.server[0], "--tls-key", pki.server[1], *more)


# --------------------------------------------------------------------------- helpers


def stub(address: str, security: ChannelSecurity) -> pb_grpc.BrokerStub:
    return pb_grpc.BrokerStub(security.channel(address))


def expect(call, request, code: grpc.StatusCode, field: str = "") -> str:
    """Call, expect ``code`` (and, given ``field``, a message starting with it); returns the
    message."""
    with pytest.raises(grpc.RpcError) as err:
        result = call(request, timeout=WAIT_S)
        if hasattr(result, "__next__"):
            next(result)  # a stream reports its error on the first read
    assert err.value.code() == code, err.value.details()
    assert not field or err.value.details().startswith(f"{field}: "), err.value.details()
    return err.value.details()


def serving(address: str, security: ChannelSecurity) -> bool:
    with security.channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pdbroker.v1.Broker"), timeout=WAIT_S
        )
    return health.status == health_pb2.HealthCheckResponse.SERVING


SCENARIO: Scenario = build_scenario(hybrid(), 1, 1, 100)


def register(caller: pb_grpc.BrokerStub, engine_id: str, role: int, index: int) -> str:
    layout = SCENARIO.prefill if role == pb.ROLE_PREFILL else SCENARIO.decode
    request = register_request(layout, engine_id, role, 0, index)
    return caller.RegisterRank(request, timeout=WAIT_S).lease_id


def publish(transfer_id: str, engine_id: str = "P", allowed=("D",)) -> pb.PublishBlocksRequest:
    return pb.PublishBlocksRequest(
        transfer_id=transfer_id,
        engine_id=engine_id,
        block_ids=[pb.BlockIds(ids=g) for g in SCENARIO.request.prefill_block_ids],
        num_tokens=SCENARIO.request.num_tokens,
        allowed_decode_engines=list(allowed),
    )


def plan(transfer_id: str, engine_id: str) -> pb.GetTransferPlanRequest:
    return pb.GetTransferPlanRequest(
        transfer_id=transfer_id,
        engine_id=engine_id,
        tp_rank=0,
        block_ids=[pb.BlockIds(ids=g) for g in SCENARIO.request.decode_block_ids],
    )


def report(plan_id: str, engine_id: str) -> pb.ReportTransferRequest:
    return pb.ReportTransferRequest(
        plan_id=plan_id, engine_id=engine_id, tp_rank=0, status=pb.REPORT_STATUS_DONE
    )


DENIED = grpc.StatusCode.PERMISSION_DENIED
NOT_FOUND = grpc.StatusCode.NOT_FOUND
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


# --------------------------------------------------------------------------- TLS


def test_tls_serves_tls_clients_only(pki: Pki) -> None:
    broker = BrokerProcess(*tls_flags(pki), security=ChannelSecurity(pki.ca))
    try:
        assert serving(broker.address, ChannelSecurity(pki.ca))
        assert serving(broker.address.replace("127.0.0.1", "localhost"), ChannelSecurity(pki.ca))
        # Without client authentication nobody is identified: anyone may act as any engine.
        caller = stub(broker.address, ChannelSecurity(pki.ca))
        register(caller, "P", pb.ROLE_PREFILL, 0)
        assert broker.list_engines() == ("P",)
        plaintext = stub(broker.address, ChannelSecurity())
        expect(plaintext.ListEngines, pb.ListEnginesRequest(), UNAVAILABLE)
        untrusting = stub(broker.address, ChannelSecurity(pki.impostor[0]))  # not the broker's CA
        expect(untrusting.ListEngines, pb.ListEnginesRequest(), UNAVAILABLE)
        assert serving(broker.address, ChannelSecurity(pki.ca))
    finally:
        broker.stop()


def test_health_port_serves_plaintext_health_alone(pki: Pki) -> None:
    """For probes that cannot speak TLS (kubelet): health in plaintext, nothing else."""
    proc = run_serve(*tls_flags(pki, "--health-port", "0"))
    try:
        health = proc.stdout.readline().rsplit(" ", 1)[1].strip()
        assert "listening on 127.0.0.1:" in proc.stdout.readline()
        assert serving(health, ChannelSecurity())
        expect(stub(health, ChannelSecurity()).ListEngines, pb.ListEnginesRequest(),
               grpc.StatusCode.UNIMPLEMENTED)  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


# --------------------------------------------------------------------------- mutual TLS


@pytest.fixture(scope="module")
def mtls_broker(pki: Pki) -> Iterator[str]:
    broker = BrokerProcess(
        *tls_flags(pki, "--tls-client-ca", pki.ca, "--admin-identities", "ops"),
        security=pki.mtls("ops"),
    )
    yield broker.address
    broker.stop()


def test_mtls_refuses_clients_without_a_certificate_of_its_ca(pki: Pki, mtls_broker: str) -> None:
    for security in (ChannelSecurity(pki.ca), ChannelSecurity(pki.ca, *pki.impostor)):
        expect(stub(mtls_broker, security).ListEngines, pb.ListEnginesRequest(), UNAVAILABLE)
    expect(stub(mtls_broker, ChannelSecurity()).ListEngines, pb.ListEnginesRequest(), UNAVAILABLE)
    assert serving(mtls_broker, pki.mtls("D"))


def test_engines_act_only_as_themselves(pki: Pki, mtls_broker: str) -> None:
    p, d, d2, ops = (stub(mtls_broker, pki.mtls(c)) for c in ("P", "D", "D2", "ops"))
    layout = SCENARIO.prefill
    message = expect(
        d.RegisterRank, register_request(layout, "P", pb.ROLE_PREFILL, 0), DENIED, "engine_id"
    )
    assert "'P'" in message and "D" in message
    p_lease = register(p, "P", pb.ROLE_PREFILL, 0)
    register(d, "D", pb.ROLE_DECODE, 1)
    register(d2, "D2", pb.ROLE_DECODE, 2)
    expect(d.KeepAlive, pb.KeepAliveRequest(lease_id=p_lease), DENIED, "lease_id")
    expect(d.Deregister, pb.DeregisterRequest(lease_id=p_lease), DENIED, "lease_id")
    assert p.KeepAlive(pb.KeepAliveRequest(lease_id=p_lease), timeout=WAIT_S).ttl_ms > 0
    expect(d.PublishBlocks, publish("a1", engine_id="P"), DENIED, "engine_id")
    expect(d.WatchReleases, pb.WatchReleasesRequest(engine_id="P"), DENIED, "engine_id")
    p.PublishBlocks(publish("a1"), timeout=WAIT_S)

    # Only decode engines the publication allows may fetch its plan, and only as themselves.
    expect(d2.GetTransferPlan, plan("a1", "D"), DENIED, "engine_id")
    # Not D2's transfer: told what an unknown id is told.
    for call, request in (
        (d2.GetTransferPlan, plan("a1", "D2")),
        (d2.GetTransfer, pb.GetTransferRequest(transfer_id="a1")),
    ):
        assert expect(call, request, NOT_FOUND, "transfer_id") == "transfer_id: no transfer 'a1'"
    plan_id = d.GetTransferPlan(plan("a1", "D"), timeout=WAIT_S).plan_id
    expect(d2.ReportTransfer, report(plan_id, "D2"), DENIED, "plan_id")
    expect(d2.ReportTransfer, report(plan_id, "D"), DENIED, "engine_id")
    expect(p.ReportTransfer, report(plan_id, "P"), DENIED, "plan_id")
    done = d.ReportTransfer(report(plan_id, "D"), timeout=WAIT_S)
    assert done.state == pb.TRANSFER_STATE_COMPLETED and done.intact

    # Parties and operators see a transfer; operators alone list.
    for caller in (p, d, ops):
        info = caller.GetTransfer(pb.GetTransferRequest(transfer_id="a1"), timeout=WAIT_S)
        assert info.state == pb.TRANSFER_STATE_COMPLETED
    expect(p.ListEngines, pb.ListEnginesRequest(), DENIED, "authorization")
    expect(d.ListTransfers, pb.ListTransfersRequest(), DENIED, "authorization")
    engines = ops.ListEngines(pb.ListEnginesRequest(), timeout=WAIT_S).engines
    assert [e.engine_id for e in engines] == ["D", "D2", "P"]


def test_decode_engines_extend_only_as_themselves_what_they_may_read(
    pki: Pki, mtls_broker: str
) -> None:
    p, d, d2 = (stub(mtls_broker, pki.mtls(c)) for c in ("P", "D", "D2"))
    register(p, "P", pb.ROLE_PREFILL, 0)
    register(d, "D", pb.ROLE_DECODE, 1)
    register(d2, "D2", pb.ROLE_DECODE, 2)
    p.PublishBlocks(publish("e1"), timeout=WAIT_S)  # for D alone

    def extend(engine_id: str) -> pb.ExtendTransfersRequest:
        name = pb.TransferName(transfer_id="e1", prefill_engine_id="P")
        return pb.ExtendTransfersRequest(engine_id=engine_id, transfers=[name])

    expect(d2.ExtendTransfers, extend("D"), DENIED, "engine_id")
    (entry,) = d2.ExtendTransfers(extend("D2"), timeout=WAIT_S).transfers
    assert entry.code == grpc.StatusCode.NOT_FOUND.value[0] and not entry.expires_at_ms
    assert entry.message.startswith("transfers[0].transfer_id: ") and "'D'" not in entry.message
    (entry,) = d.ExtendTransfers(extend("D"), timeout=WAIT_S).transfers
    assert entry.code == 0 and entry.expires_at_ms and entry.ttl_ms


def test_batched_calls_authorize_the_call_and_each_entry(pki: Pki, mtls_broker: str) -> None:
    """A batch acts as one engine (the caller's); each report must be of that engine's plan,
    each plan of a transfer it may read: one refused entry leaves the others alone."""
    p, d, d2 = (stub(mtls_broker, pki.mtls(c)) for c in ("P", "D", "D2"))
    register(p, "P", pb.ROLE_PREFILL, 0)
    register(d, "D", pb.ROLE_DECODE, 1)
    register(d2, "D2", pb.ROLE_DECODE, 2)
    for transfer_id, allowed in (("bt1", ("D",)), ("bt2", ("D2",))):
        p.PublishBlocks(publish(transfer_id, allowed=allowed), timeout=WAIT_S)

    def plans(engine_id: str, *transfer_ids: str) -> pb.GetTransferPlansRequest:
        return pb.GetTransferPlansRequest(
            engine_id=engine_id, entries=[plan(t, "") for t in transfer_ids]
        )

    expect(d2.GetTransferPlans, plans("D", "bt1"), DENIED, "engine_id")
    mine, not_mine = d.GetTransferPlans(plans("D", "bt1", "bt2"), timeout=WAIT_S).results
    assert mine.code == 0 and mine.plan.total_bytes
    assert (not_mine.code, not_mine.message) == (
        NOT_FOUND.value[0],
        "entries[1].transfer_id: no transfer 'bt2'",
    )
    (theirs,) = d2.GetTransferPlans(plans("D2", "bt2"), timeout=WAIT_S).results
    reports = pb.ReportTransfersRequest(
        engine_id="D2", reports=[report(theirs.plan.plan_id, ""), report(mine.plan.plan_id, "")]
    )
    expect(d.ReportTransfers, reports, DENIED, "engine_id")
    own, stolen = d2.ReportTransfers(reports, timeout=WAIT_S).results
    assert own.code == 0 and own.outcome.intact
    assert stolen.code == DENIED.value[0] and stolen.message.startswith("reports[1].plan_id: ")
    info = d.GetTransfer(pb.GetTransferRequest(transfer_id="bt1"), timeout=WAIT_S)
    assert info.state == pb.TRANSFER_STATE_IN_PROGRESS  # D's plan stays unreported


def test_only_parties_and_operators_abort(pki: Pki, mtls_broker: str) -> None:
    p, p2, d, d2, ops = (stub(mtls_broker, pki.mtls(c)) for c in ("P", "P2", "D", "D2", "ops"))
    register(p, "P", pb.ROLE_PREFILL, 0)
    register(p2, "P2", pb.ROLE_PREFILL, 3)
    register(d, "D", pb.ROLE_DECODE, 1)
    register(d2, "D2", pb.ROLE_DECODE, 2)
    p.PublishBlocks(publish("b1"), timeout=WAIT_S)  # for D only
    p.PublishBlocks(publish("b2", allowed=()), timeout=WAIT_S)  # for any decode engine
    p.PublishBlocks(publish("b3"), timeout=WAIT_S)
    for transfer_id in ("b1", "b2"):
        abort = pb.AbortTransferRequest(transfer_id=transfer_id, reason="not mine")
        expect(p2.AbortTransfer, abort, NOT_FOUND, "transfer_id")  # another prefill engine
    abort = pb.AbortTransferRequest(transfer_id="b1", reason="not addressed to me")
    expect(d2.AbortTransfer, abort, NOT_FOUND, "transfer_id")
    aborted = pb.TRANSFER_STATE_ABORTED
    by_reader = d2.AbortTransfer(pb.AbortTransferRequest(transfer_id="b2"), timeout=WAIT_S)
    assert by_reader.state == aborted  # any decode engine may read b2, so may decline it
    by_addressee = d.AbortTransfer(pb.AbortTransferRequest(transfer_id="b1"), timeout=WAIT_S)
    assert by_addressee.state == aborted
    by_operator = ops.AbortTransfer(pb.AbortTransferRequest(transfer_id="b3"), timeout=WAIT_S)
    assert by_operator.state == aborted
    p.PublishBlocks(publish("b4"), timeout=WAIT_S)
    by_owner = p.AbortTransfer(pb.AbortTransferRequest(transfer_id="b4"), timeout=WAIT_S)
    assert by_owner.state == aborted
    # The broker kept serving everyone through the refusals.
    p.PublishBlocks(publish("b5"), timeout=WAIT_S)
    assert d.GetTransferPlan(plan("b5", "D"), timeout=WAIT_S).plan_id


def test_a_squatted_transfer_id_costs_its_owner_nothing_and_tells_the_squatter_nothing(
    pki: Pki, mtls_broker: str
) -> None:
    """P2 publishes the id P is about to use: P's publication still succeeds (P2 learns
    nothing of it), each engine sees and aborts its own transfer without naming itself, and
    D, addressed by both, reads the one of the prefill engine it names."""
    p, p2, d, d2 = (stub(mtls_broker, pki.mtls(c)) for c in ("P", "P2", "D", "D2"))
    register(p, "P", pb.ROLE_PREFILL, 0)
    register(p2, "P2", pb.ROLE_PREFILL, 3)
    register(d, "D", pb.ROLE_DECODE, 1)
    register(d2, "D2", pb.ROLE_DECODE, 2)
    p2.PublishBlocks(publish("s1", engine_id="P2"), timeout=WAIT_S)  # squatted
    p.PublishBlocks(publish("s1"), timeout=WAIT_S)
    expect(p.PublishBlocks, publish("s1"), grpc.StatusCode.ALREADY_EXISTS, "transfer_id")
    for caller, engine in ((p, "P"), (p2, "P2")):
        info = caller.GetTransfer(pb.GetTransferRequest(transfer_id="s1"), timeout=WAIT_S)
        assert info.prefill_engine_id == engine
    # D may read both: it must say which; D2 may read neither: there is no such transfer.
    expect(
        d.GetTransferPlan, plan("s1", "D"), grpc.StatusCode.FAILED_PRECONDITION, "prefill_engine_id"
    )
    expect(d2.GetTransfer, pb.GetTransferRequest(transfer_id="s1"), NOT_FOUND, "transfer_id")
    ask = plan("s1", "D")
    ask.prefill_engine_id = "P"
    plan_id = d.GetTransferPlan(ask, timeout=WAIT_S).plan_id
    assert d.ReportTransfer(report(plan_id, "D"), timeout=WAIT_S).intact
    aborted = p2.AbortTransfer(pb.AbortTransferRequest(transfer_id="s1"), timeout=WAIT_S)
    assert aborted.state == pb.TRANSFER_STATE_ABORTED  # P2's own
    info = p.GetTransfer(pb.GetTransferRequest(transfer_id="s1"), timeout=WAIT_S)
    assert info.state == pb.TRANSFER_STATE_COMPLETED  # P's, untouched


def test_status_command_needs_an_operator_certificate(pki: Pki, mtls_broker: str) -> None:
    def status(caller: str, ca: str = pki.ca) -> subprocess.CompletedProcess:
        cert, key = pki.clients[caller]
        tls_ca = ("--tls-ca", ca) if ca else ()
        return subprocess.run(
            [sys.executable, "-m", "broker.cli", "status", "--json", "--broker", mtls_broker,
             *tls_ca, "--tls-cert", cert, "--tls-key", key],
            check=False, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    assert json.loads(status("ops").stdout)["now_ms"] > 0
    refused = status("P")
    assert refused.returncode == 1
    assert "ListEngines" in refused.stderr and "PERMISSION_DENIED: authorization:" in refused.stderr
    without_ca = status("ops", ca="")
    assert without_ca.returncode == 2 and "error: --tls-ca: " in without_ca.stderr


def status_line(*flags: str) -> str:
    """``pdbroker status`` with ``flags``: exit status 2 and one stderr line; returns it."""
    done = subprocess.run(
        [sys.executable, "-m", "broker.cli", "status", *flags],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.count("\n") == 1, done.stderr
    return done.stderr.strip()


def test_status_says_when_it_and_the_broker_disagree_about_tls(pki: Pki, mtls_broker: str) -> None:
    """A plaintext call to a TLS port fails as "Socket closed", a TLS call to a plaintext
    port as a handshake failure; the command names the cause and ``--tls-ca`` instead."""
    assert status_line("--broker", mtls_broker) == (
        f"pdbroker status: error: --tls-ca: the broker at {mtls_broker} serves TLS: pass "
        "--tls-ca with the CA of its certificate (and the credentials it asks for)"
    )
    plaintext = BrokerProcess()
    try:
        assert status_line("--broker", plaintext.address, "--tls-ca", pki.ca) == (
            f"pdbroker status: error: --tls-ca: the broker at {plaintext.address} serves "
            "plaintext (serve --insecure): leave out --tls-ca, --tls-cert, --tls-key and "
            "--token-file"
        )
    finally:
        plaintext.stop()


def test_demo_against_a_tls_broker_says_its_engines_speak_plaintext(mtls_broker: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "broker.cli", "demo", "--broker", mtls_broker],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        f"pdbroker demo: error: --broker: {mtls_broker} serve TLS; the demo's engines connect "
        "in plaintext, to brokers started with --insecure\n"
    )


# --------------------------------------------------------------------------- bearer tokens


def test_bearer_tokens_identify_callers(pki: Pki) -> None:
    broker = BrokerProcess(
        *tls_flags(pki, "--auth-tokens", pki.tokens_file, "--admin-identities", "ops"),
        "--metrics-port",
        "0",
        security=pki.token("ops"),
    )
    try:
        address = broker.address
        layout = SCENARIO.prefill
        wrong = stub(address, ChannelSecurity(pki.ca, token="not-a-token-of-anyone"))
        message = expect(
            wrong.RegisterRank, register_request(layout, "P", pb.ROLE_PREFILL, 0),
            UNAUTHENTICATED, "authorization",
        )  # fmt: skip
        assert "unknown bearer token" in message
        missing = stub(address, ChannelSecurity(pki.ca))
        expect(missing.ListEngines, pb.ListEnginesRequest(), UNAUTHENTICATED, "authorization")
        p, d = stub(address, pki.token("P")), stub(address, pki.token("D"))
        register(p, "P", pb.ROLE_PREFILL, 0)
        register(d, "D", pb.ROLE_DECODE, 1)
        expect(d.PublishBlocks, publish("c1", engine_id="P"), DENIED, "engine_id")
        p.PublishBlocks(publish("c1"), timeout=WAIT_S)
        assert d.GetTransferPlan(plan("c1", "D"), timeout=WAIT_S).plan_id
        assert broker.list_engines() == ("D", "P")
        # calls refused before their request are counted as the others
        metrics = urllib.request.urlopen(broker.metrics_url, timeout=WAIT_S).read().decode()
        handled = {
            (s.labels["grpc_method"], s.labels["grpc_code"]): s.value
            for family in text_string_to_metric_families(metrics)
            for s in family.samples
            if s.name == "grpc_server_handled_total" and s.value
        }
        assert handled == {
            ("RegisterRank", "Unauthenticated"): 1,
            ("ListEngines", "Unauthenticated"): 1,
            ("RegisterRank", "OK"): 2,
            ("PublishBlocks", "PermissionDenied"): 1,
            ("PublishBlocks", "OK"): 1,
            ("GetTransferPlan", "OK"): 1,
            ("ListEngines", "OK"): 1,
        }
    finally:
        broker.stop()


def test_ranks_per_identity_are_bounded(pki: Pki) -> None:
    """An identity registers at most --max-ranks-per-identity ranks over the engines it
    names; registering a held rank again takes no more, and other identities go on."""
    broker = BrokerProcess(
        *tls_flags(pki, "--auth-tokens", pki.tokens_file, "--max-ranks-per-identity", "1")
    )
    try:
        p, d = stub(broker.address, pki.token("P")), stub(broker.address, pki.token("D"))
        register(p, "P", pb.ROLE_PREFILL, 0)
        register(p, "P", pb.ROLE_PREFILL, 0)  # the same rank again
        wider = build_scenario(hybrid(), 2, 1, 100).prefill
        message = expect(
            p.RegisterRank,
            register_request(wider, "P", pb.ROLE_PREFILL, 1),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "tp_rank",
        )
        assert "holds 1 registered ranks" in message and "--max-ranks-per-identity" in message
        register(d, "D", pb.ROLE_DECODE, 1)
    finally:
        broker.stop()


# --------------------------------------------------------------------------- serve flags


def run_serve(*flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "broker.cli", "serve", "--listen", "127.0.0.1:0", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def refused(*flags: str) -> str:
    """Start serve with ``flags``: it must exit at once with status 2 (a configuration
    error); returns its stderr."""
    proc = run_serve(*flags)
    assert proc.wait(30) == 2
    assert "listening on" not in proc.stdout.read()
    return proc.stderr.read()


def test_serve_refuses_to_start_without_tls_or_insecure(pki: Pki, tmp_path: Path) -> None:
    assert "--tls-cert: required (with --tls-key) unless --insecure" in refused()
    assert "--tls-key: required with --tls-cert" in refused("--tls-cert", pki.server[0])
    both = refused("--insecure", "--tls-cert", pki.server[0], "--tls-key", pki.server[1])
    assert "--insecure: cannot be combined with --tls-cert, --tls-key" in both
    assert "--auth-tokens" in refused("--insecure", "--auth-tokens", pki.tokens_file)
    assert "--admin-identities: callers are only identified" in refused(
        *tls_flags(pki, "--admin-identities", "ops")
    )
    missing = str(tmp_path / "missing.pem")
    assert f"--tls-cert: cannot read {missing}" in refused(
        "--tls-cert", missing, "--tls-key", missing
    )
    short = tmp_path / "tokens"
    short.write_text("P: short\n")
    assert f"--auth-tokens: {short}:1: the token of 'P' is shorter than" in refused(
        *tls_flags(pki, "--auth-tokens", str(short))
    )


def refused_in_one_line(flag: str, *flags: str) -> str:
    """Start serve with ``flags``: exit status 2 and one stderr line naming ``flag``, no
    traceback; returns that line."""
    stderr = refused(*flags)
    assert stderr.endswith("\n") and stderr.count("\n") == 1, stderr
    assert stderr.startswith(f"pdbroker serve: error: {flag}: "), stderr
    return stderr.strip()


def test_serve_refuses_bad_files_in_one_line_naming_the_flag(pki: Pki, tmp_path: Path) -> None:
    cert, key = pki.server
    other_key = pki.clients["P"][1]  # a valid key, of another certificate
    junk = tmp_path / "junk.pem"
    junk.write_text("not a PEM file\n")
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00\x01" * 8)
    mismatch = refused_in_one_line("--tls-key", "--tls-cert", cert, "--tls-key", other_key)
    assert f"{other_key} is not the private key of the certificate in {cert}" in mismatch
    assert "holds no PEM certificate" in refused_in_one_line(
        "--tls-cert", "--tls-cert", str(junk), "--tls-key", key
    )
    assert "holds no PEM certificate" in refused_in_one_line(
        "--tls-cert", "--tls-cert", str(binary), "--tls-key", key
    )
    assert "holds no unencrypted PEM private key" in refused_in_one_line(
        "--tls-key", "--tls-cert", cert, "--tls-key", str(junk)
    )
    assert "holds no unencrypted PEM private key" in refused_in_one_line(
        "--tls-key", "--tls-cert", cert, "--tls-key", cert
    )
    assert "holds no PEM certificate" in refused_in_one_line(
        "--tls-client-ca", *tls_flags(pki, "--tls-client-ca", str(junk))
    )
    assert "cannot read" in refused_in_one_line(
        "--tls-key", "--tls-cert", cert, "--tls-key", str(tmp_path)
    )
    token = pki.tokens["P"]
    malformed = tmp_path / "tokens"
    malformed.write_text(f"P: {token}\n{token}\n")  # a line without its name
    line = refused_in_one_line("--auth-tokens", *tls_flags(pki, "--auth-tokens", str(malformed)))
    assert line.endswith(f"{malformed}:2: expected 'NAME: TOKEN'")
    assert token not in line
    assert "--auth-tokens: " in refused_in_one_line(
        "--auth-tokens", *tls_flags(pki, "--auth-tokens", str(binary))
    )


def test_insecure_is_explicit_and_warns() -> None:
    """The warning names the port bound, not the 0 asked for."""
    proc = run_serve("--insecure")
    try:
        address = proc.stdout.readline().removeprefix("pdbroker serve: listening on ").strip()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    assert address.startswith("127.0.0.1:") and not address.endswith(":0")
    log = proc.stderr.read()
    assert "WARNING" in log and "--insecure: serving plaintext without authentication" in log
    assert f"any process that reaches {address} may act as any engine" in log


# --------------------------------------------------------------------------- clients


def test_clients_warn_about_plaintext_beyond_loopback(caplog: pytest.LogCaptureFixture) -> None:
    for target in ("127.0.0.1:1", "localhost:1", "[::1]:1", "dns:///localhost:1", "unix:/x"):
        ChannelSecurity().channel(target).close()
    assert not caplog.records
    ChannelSecurity().channel("10.1.2.3:50151").close()
    ChannelSecurity(flags=True).channel("10.1.2.3:50151").close()
    settings, flags = caplog.records
    assert settings.levelname == "WARNING" and "10.1.2.3:50151 without TLS" in settings.message
    assert "(set tls_ca to use TLS)" in settings.message  # the vLLM connector's setting
    assert "(set --tls-ca to use TLS)" in flags.message  # the command's flag


def test_client_credentials_need_tls(pki: Pki) -> None:
    with pytest.raises(ValueError, match="^tls_ca: "):
        ChannelSecurity(token="token-of-P-0123456789abcdef")
    with pytest.raises(ValueError, match="^tls_ca: "):
        ChannelSecurity(tls_cert=pki.clients["P"][0], tls_key=pki.clients["P"][1])
    with pytest.raises(ValueError, match="^tls_cert: "):
        ChannelSecurity(pki.ca, tls_cert=pki.clients["P"][0])
    with pytest.raises(ValueError, match="^--tls-cert: .* both --tls-cert and --tls-key$"):
        ChannelSecurity(pki.ca, tls_cert=pki.clients["P"][0], flags=True)
    assert pki.tokens["P"] not in repr(pki.token("P"))  # tokens stay out of logs


# --------------------------------------------------------------------------- end to end


def test_transfers_between_real_engines_over_mutual_tls(pki: Pki) -> None:
    """A prefill and a decode engine process, each with its own certificate (the prefill's
    names its engine id in a subject alternative name), move and verify every byte."""
    require_module("nixl", "engine")
    model = ModelSpec("tiny", ((GroupKind.ATTENTION, ("a0", "a1")),), AttentionParams(2, 32), None)
    pair = PairSpec("attention P1->D1", model, 1, 1, 40, 120)
    broker = BrokerProcess(
        *tls_flags(pki, "--tls-client-ca", pki.ca, "--admin-identities", "ops"),
        security=pki.mtls("ops"),
    )
    try:
        fleet = run_fleet(
            [pair], 2, broker=broker,
            credentials={e: pki.mtls(e) for e in ("prefill-0", "decode-0")},
        )  # fmt: skip
    finally:
        broker.stop()
    assert fleet.problems() == []
    assert fleet.completed == 2 and all(r.fetched and r.mismatches == 0 for r in fleet.requests)
    assert all(r.nbytes == r.expected_bytes > 0 for r in fleet.requests)
    assert fleet.leftover_engines == ()
