"""Cross-host on one machine: the broker, a prefill host and a decode host each in a network
namespace of their own, joined by veth pairs to a bridge in a fourth ("switch") namespace,
addresses 10.200.0.0/24 that exist only inside those namespaces. The engines are
:func:`harness.engines.engine_main` processes started with ``ip netns exec``; NIXL moves the
bytes with UCX over TCP (``UCX_TLS=tcp``) across the veths, and decode compares every byte.
Taking the decode host's link down must end in clean, bounded failures, and bringing it back
in working transfers again. Needs root and ``ip netns``; skips with the reason otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe, wait
from pathlib import Path

import pytest
from prerequisites import require_binary, require_module, unavailable

require_module("nixl", "engine")

from broker_helpers import hybrid

from harness.engines import engine_main
from harness.fleet import PairSpec

ROOT = Path(__file__).parent.parent
SUBNET = "10.200.0"
HOSTS = {"broker": 1, "prefill": 2, "decode": 3}
PAIR = PairSpec("netns P1->D2", hybrid(), 1, 2, 40, 300)
LEASE_MS = 2_000
TRANSFER_TTL_MS = 4_000
#: Longest one message from an engine may take (its broker calls time out after 10 s).
ANSWER_S = 60.0


@dataclass
class Topology:
    """Namespace names per host and the switch-side veth of each host."""

    tag: str

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def switch_port(self, host: str) -> str:
        return f"{self.tag[-6:]}{host[0]}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{HOSTS[host]}"

    def link(self, host: str, up: bool) -> None:
        ip("-n", self.ns("switch"), "link", "set", self.switch_port(host), "up" if up else "down")

    def tx_bytes(self, host: str) -> int:
        (link,) = json.loads(ip("-n", self.ns(host), "-j", "-s", "link", "show", "eth0"))
        return int(link["stats64"]["tx"]["bytes"])


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


def build(topo: Topology) -> None:
    ip("netns", "add", topo.ns("switch"))
    ip("-n", topo.ns("switch"), "link", "add", "br0", "type", "bridge")
    ip("-n", topo.ns("switch"), "link", "set", "br0", "up")
    for host in HOSTS:
        ns, port = topo.ns(host), topo.switch_port(host)
        ip("netns", "add", ns)
        ip(
            "link",
            "add",
            port,
            "netns",
            topo.ns("switch"),
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            ns,
        )
        ip("-n", topo.ns("switch"), "link", "set", port, "master", "br0", "up")
        ip("-n", ns, "addr", "add", f"{topo.address(host)}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")


def teardown(topo: Topology) -> None:
    for host in (*HOSTS, "switch"):
        subprocess.run(["ip", "netns", "del", topo.ns(host)], check=False, capture_output=True)


@pytest.fixture(scope="module")
def topology() -> Iterator[Topology]:
    if os.geteuid() != 0:
        unavailable("network namespaces need root")
    require_binary("ip", "apt-get install iproute2 (bash scripts/test.sh does, as root)")
    topo = Topology(f"pdbt{uuid.uuid4().hex[:6]}")
    try:
        build(topo)
    except subprocess.CalledProcessError as exc:
        teardown(topo)
        unavailable(f"cannot create network namespaces and veths here: {exc.stderr.strip()}")
    yield topo
    teardown(topo)


def host_main(fd: int) -> None:
    """Entry point of an engine host process: the coordinator sends ``engine_main``'s
    arguments on the inherited connection ``fd``, which then serves its commands."""
    conn = Connection(fd)
    role, engine_id, layout, peer, target, seed = conn.recv()
    engine_main(role, engine_id, layout, peer, target, conn, seed)


class Host:
    """One engine process in ``ns``, driven over a pipe with ``engine_main``'s commands."""

    def __init__(self, ns: str, role: str, engine_id: str, layout, peer, target: str) -> None:
        self.engine_id = engine_id
        self.conn, child = Pipe()
        env = os.environ | {
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
            "UCX_TLS": "tcp",
            "UCX_NET_DEVICES": "eth0",
            "NIXL_LOG_LEVEL": "WARN",
        }
        self.process = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-c",
                f"from test_netns import host_main; host_main({child.fileno()})",
            ],
            pass_fds=[child.fileno()],
            env=env,
            cwd=ROOT,
        )
        child.close()
        self.conn.send((role, engine_id, layout, peer, target, 7))

    def receive(self, timeout_s: float = ANSWER_S) -> tuple:
        if not wait([self.conn], timeout_s):
            raise AssertionError(f"{self.engine_id} did not answer within {timeout_s} s")
        message = self.conn.recv()
        assert message[0] != "error", message[2]
        return message

    def close(self) -> None:
        try:
            self.conn.send(("close",))
            while self.receive(30)[0] != "closed":
                pass
        finally:
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class Fleet:
    topology: Topology
    broker: subprocess.Popen
    prefill: Host
    decode: Host
    requests: int = 0

    def transfer(self, num_tokens: int = 200) -> tuple[str, tuple, list[tuple]]:
        """Publish one request and fetch it; returns the transfer id, decode's answer
        (``fetched`` or ``fetch_failed``) and the prefill releases (all ranks)."""
        self.requests += 1
        transfer_id, salt = f"req-{self.requests}", self.requests
        self.prefill.conn.send(("publish", transfer_id, num_tokens, salt))
        published = self.prefill.receive()
        assert published[:2] == ("published", transfer_id), published
        self.decode.conn.send(("fetch", transfer_id, num_tokens, salt, published[5]))
        fetched = self.decode.receive()
        releases = [self.prefill.receive() for _ in range(PAIR.prefill_tp)]
        assert {r[1] for r in releases} == {transfer_id}
        return transfer_id, fetched, releases


@pytest.fixture(scope="module")
def fleet(topology: Topology) -> Iterator[Fleet]:
    """A broker at 10.200.0.1, prefill (TP1) at .2 and decode (TP2) at .3."""
    address = f"{topology.address('broker')}:50151"
    broker = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            topology.ns("broker"),
            sys.executable,
            "-m",
            "broker.cli",
            "serve",
            "--insecure",
            "--listen",
            address,
            "--lease-ttl-ms",
            str(LEASE_MS),
            "--default-ttl-ms",
            str(TRANSFER_TTL_MS),
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert "listening on" in broker.stdout.readline()
    prefill_layout, decode_layout = PAIR.layouts(inflight=2)
    hosts: list[Host] = []
    try:
        hosts.append(
            Host(
                topology.ns("prefill"),
                "prefill",
                "prefill-0",
                prefill_layout,
                decode_layout,
                address,
            )
        )
        hosts.append(
            Host(
                topology.ns("decode"), "decode", "decode-0", decode_layout, prefill_layout, address
            )
        )
        for host in hosts:
            assert host.receive()[0] == "ready"
        yield Fleet(topology, broker, *hosts)
    finally:
        for host in hosts:
            host.close()
        broker.terminate()
        broker.wait(10)


def test_bytes_cross_the_veths_and_match(fleet: Fleet) -> None:
    sent_before = fleet.topology.tx_bytes("prefill")
    moved = 0
    for _ in range(3):
        _, fetched, releases = fleet.transfer()
        assert fetched[0] == "fetched", fetched
        _, _, ranks, mismatches, expected, checked, _ = fetched
        assert mismatches == 0 and expected == sum(r["nbytes"] for r in ranks) > 0
        assert sorted(r["tp_rank"] for r in ranks) == [0, 1]
        assert checked == sum(r.region_bytes * r.num_regions for r in PAIR.layouts(2)[1].ranks)
        assert [r[3] for r in releases] == ["completed"]
        moved += expected
    # The state left the prefill host through its veth: UCX used TCP between the hosts.
    assert fleet.topology.tx_bytes("prefill") - sent_before >= moved


def test_a_cut_link_fails_cleanly_and_recovers(fleet: Fleet) -> None:
    """Decode's link goes down: its fetch fails within the call timeout, its lease lapses,
    the unread transfer expires and prefill gets its blocks back (EXPIRED). Once the link is
    up again decode registers again and transfers verify again."""
    topo = fleet.topology
    topo.link("decode", up=False)
    try:
        started = time.monotonic()
        _, fetched, releases = fleet.transfer()
        failed_after = time.monotonic() - started
        assert fetched[0] == "fetch_failed" and "DEADLINE_EXCEEDED" in fetched[2], fetched
        assert failed_after < 30
        assert [r[3] for r in releases] == ["expired"]
    finally:
        topo.link("decode", up=True)
    restored = time.monotonic()
    while True:
        _, fetched, releases = fleet.transfer()
        if fetched[0] == "fetched":
            break
        assert time.monotonic() - restored < 60, f"no recovery: {fetched}"
        time.sleep(0.5)
    assert fetched[3] == 0 and [r[3] for r in releases] == ["completed"]
    print(
        f"link down: fetch failed after {failed_after:.1f} s; link up: transfers verify "
        f"again after {time.monotonic() - restored:.1f} s"
    )
