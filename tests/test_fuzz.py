"""Fuzzing one live broker over gRPC (hypothesis; the atheris harness is tests/fuzz_atheris.py).

Every input is sent as raw bytes to one in-process server: valid requests built from what the
broker accepted so far, the same with fields mutated through the protobuf descriptors
(boundary integers, odd strings, repeated fields cleared, duplicated or grown), valid bytes
corrupted, and random bytes. Each reply must be OK or a contract status naming a field, no
call may hang, and every plan must stay inside the registered regions
(:class:`fuzz_support.Fuzzer`). Afterwards the broker still serves a full transfer, and a
transfer published before the fuzzing is intact.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from broker_helpers import register_request
from fuzz_support import DECODE, METHODS, PREFILL, Fuzzer, LiveBroker, Requests
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from prerequisites import require_module

from broker.v1 import broker_pb2 as pb

#: Inputs of the default run: EXAMPLES examples of CALLS inputs each, plus the set-up.
EXAMPLES, CALLS = 1_000, 10
MIN_INPUTS = 10_000
ATHERIS_RUNS = 3_000

_RANGES = {
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_ENUM: (-(2**31), 2**31 - 1),
}
_EDGES = [0, 1, 2, 3, 7, 64, 4096, 4097, 1 << 20, 2**31 - 1, 2**32 - 1, 2**53, 2**62]
_EDGES += [2**63 - 1, 2**63, 2**64 - 1, -1, -(2**31), -(2**63)]
_STRINGS = ["", PREFILL, DECODE, "X", "t0", "x" * 257, "a\x00b", "\x1b[2J", "é", "a]b'c", "kv"]
_STRINGS += ["ssm", "conv.x", "float32", "torch.bfloat16", "fp8", "ä" * 300]
_KINDS = ["valid", "mutated", "mutated", "corrupt", "garbage"]
#: Every method, the transfer path more often (a plan needs a live publication).
_METHODS = sorted(METHODS) + ["PublishBlocks", "PublishBlocks", "ReportTransfer"]
_METHODS += ["GetTransferPlan", "GetTransferPlan", "GetTransferPlan"]
#: One input: method, kind, and the seed of every further choice. Hypothesis covers methods
#: and kinds and spreads the seeds; the choices come from :class:`random.Random` because
#: they depend on the broker's state (hypothesis wants generation independent of it) and
#: because a hypothesis draw per choice would not fit 10,000 inputs into the time budget.
_INPUT = st.tuples(st.sampled_from(_METHODS), st.sampled_from(_KINDS), st.integers(0, 2**32))


def _slots(msg: Message) -> list[tuple[Message, FieldDescriptor]]:
    """Every field of ``msg`` and of the messages inside it."""
    out = []
    for fd in msg.DESCRIPTOR.fields:
        out.append((msg, fd))
        if fd.type == FieldDescriptor.TYPE_MESSAGE:
            if fd.is_repeated:
                for item in getattr(msg, fd.name):
                    out += _slots(item)
            elif msg.HasField(fd.name):
                out += _slots(getattr(msg, fd.name))
    return out


def _value(fd: FieldDescriptor, rnd: random.Random) -> int | str | bytes | bool:
    """A value for scalar field ``fd``: boundary integers or any in its range, odd or
    random strings, random bytes."""
    if fd.type == FieldDescriptor.TYPE_BOOL:
        return rnd.random() < 0.5
    if fd.type == FieldDescriptor.TYPE_STRING:
        text = rnd.choice(_STRINGS)
        return text if rnd.random() < 0.7 else "".join(chr(rnd.randrange(0x2FF)) for _ in text)
    if fd.type == FieldDescriptor.TYPE_BYTES:
        return rnd.randbytes(rnd.choice([0, 1, 24, 64]))
    lo, hi = _RANGES[fd.type]
    if rnd.random() < 0.7:
        return rnd.choice([e for e in _EDGES if lo <= e <= hi])
    return rnd.randint(lo, hi)


def _mutate(msg: Message, rnd: random.Random) -> None:
    """Change one field somewhere in ``msg`` (if it has any): set a scalar, clear a field,
    drop, duplicate or add elements of a repeated one, or add thousands."""
    slots = _slots(msg)
    if not slots:
        return
    parent, fd = rnd.choice(slots)
    field = getattr(parent, fd.name)
    message = fd.type == FieldDescriptor.TYPE_MESSAGE
    if not fd.is_repeated:
        if (fd.has_presence or message) and rnd.random() < 0.3:
            parent.ClearField(fd.name)
        elif message:
            field.Clear()
            field.SetInParent()
        else:
            setattr(parent, fd.name, _value(fd, rnd))
        return
    op = rnd.choice(["clear", "drop", "copy", "set", "add", "grow"])
    if op == "clear" or (op in ("drop", "copy", "set") and not field):
        del field[:]
    elif op == "drop":
        del field[rnd.randrange(len(field))]
    elif op == "copy":
        item = field[rnd.randrange(len(field))]
        field.add().CopyFrom(item) if message else field.append(item)
    elif op == "set" and not message:
        field[rnd.randrange(len(field))] = _value(fd, rnd)
    else:
        for _ in range(rnd.choice([2, 300, 5000]) if op == "grow" else 1):
            field.add() if message else field.append(_value(fd, rnd))


def _corrupt(payload: bytes, rnd: random.Random) -> bytes:
    """``payload`` with a few bytes flipped, cut or inserted."""
    buf = bytearray(payload)
    for _ in range(rnd.randint(1, 3)):
        at = rnd.randint(0, len(buf))
        op = rnd.choice(["flip", "cut", "insert"])
        if op == "flip" and at < len(buf):
            buf[at] ^= rnd.randint(1, 255)
        elif op == "cut":
            del buf[at:]
        else:
            buf[at:at] = rnd.randbytes(rnd.randint(1, 8))
    return bytes(buf)


def _materialize(drawn: tuple[str, str, int], requests: Requests) -> tuple[str, bytes]:
    """The method and bytes an :data:`_INPUT` stands for, given the broker's state now."""
    method, kind, seed = drawn
    rnd = random.Random(seed)
    if kind == "garbage":
        return method, rnd.randbytes(rnd.randint(0, 96))
    request = requests.builders[method](lambda seq: rnd.choice(list(seq)))
    if kind == "mutated":
        for _ in range(rnd.randint(1, 3)):
            _mutate(request, rnd)
    payload = request.SerializeToString()
    return method, _corrupt(payload, rnd) if kind == "corrupt" else payload


@pytest.fixture
def live() -> Iterator[tuple[LiveBroker, Fuzzer, Requests]]:
    broker = LiveBroker()
    fuzzer = Fuzzer(broker)
    try:
        yield broker, fuzzer, Requests(fuzzer.model)
    finally:
        broker.stop()


def _full_transfer(fuzzer: Fuzzer, requests: Requests, prefix: str, index: int) -> str:
    """Register a fresh prefill and decode engine under ``prefix``, publish, and plan every
    decode rank (the fuzzer checks the plans); returns the transfer id."""
    p, d = requests.engines[PREFILL], requests.engines[DECODE]
    for engine, role, offset in ((p, pb.ROLE_PREFILL, 0), (d, pb.ROLE_DECODE, 1)):
        for rank in range(engine.layout.tp_size):
            request = register_request(
                engine.layout, f"{prefix}-{engine.engine_id}", role, rank, index + offset
            )
            assert fuzzer.call("RegisterRank", request.SerializeToString()) is not None
    transfer_id = f"{prefix}-transfer"
    publish = requests.publish(lambda seq: next(iter(seq)))
    publish.transfer_id, publish.engine_id = transfer_id, f"{prefix}-{PREFILL}"
    del publish.allowed_decode_engines[:]
    assert fuzzer.call("PublishBlocks", publish.SerializeToString()) is not None
    return transfer_id


def _plan_and_report(fuzzer: Fuzzer, requests: Requests, prefix: str, transfer_id: str) -> None:
    """Every decode rank of ``prefix`` plans and reports DONE: the transfer completes."""
    d = requests.engines[DECODE]
    for rank in range(d.layout.tp_size):
        query = pb.GetTransferPlanRequest(
            transfer_id=transfer_id,
            engine_id=f"{prefix}-{DECODE}",
            tp_rank=rank,
            block_ids=[pb.BlockIds(ids=g) for g in d.block_ids],
        )
        plan = pb.GetTransferPlanResponse.FromString(
            fuzzer.call("GetTransferPlan", query.SerializeToString())
        )
        assert plan.num_descriptors > 0
        report = pb.ReportTransferRequest(
            plan_id=plan.plan_id,
            engine_id=f"{prefix}-{DECODE}",
            tp_rank=rank,
            status=pb.REPORT_STATUS_DONE,
            bytes_moved=plan.total_bytes,
        )
        reply = pb.ReportTransferResponse.FromString(
            fuzzer.call("ReportTransfer", report.SerializeToString())
        )
        assert reply.intact
    assert reply.state == pb.TRANSFER_STATE_COMPLETED


def test_fuzz_live_broker(live: tuple[LiveBroker, Fuzzer, Requests]) -> None:
    broker, fuzzer, requests = live
    started = time.monotonic()
    sentinel = _full_transfer(fuzzer, requests, "sentinel", 10)
    for request in requests.every_rank():
        assert fuzzer.call("RegisterRank", request.SerializeToString()) is not None

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(_INPUT, min_size=CALLS, max_size=CALLS))
    def fuzz(inputs: list[tuple]) -> None:
        for drawn in inputs:
            fuzzer.call(*_materialize(drawn, requests))

    fuzz()
    # Still serving: what was published before is intact, and a new transfer goes through.
    state = pb.GetTransferResponse.FromString(
        fuzzer.call("GetTransfer", pb.GetTransferRequest(transfer_id=sentinel).SerializeToString())
    ).state
    assert state == pb.TRANSFER_STATE_PUBLISHED
    _plan_and_report(fuzzer, requests, "sentinel", sentinel)
    _plan_and_report(fuzzer, requests, "after", _full_transfer(fuzzer, requests, "after", 20))
    model = fuzzer.model
    print(
        f"fuzz: {model.inputs} inputs, {model.ok} OK, {len(model.plans)} plans checked, "
        f"{time.monotonic() - started:.1f} s"
    )
    assert model.inputs >= MIN_INPUTS
    assert broker.thread.is_alive()


#: libFuzzer's memory limit for the harness. Linux keeps a process's peak RSS across exec, so
#: the harness starts with the peak of the pytest process that forked it (GBs once vLLM was
#: imported) and libFuzzer's 2 GB default would call that an out-of-memory input.
ATHERIS_RSS_LIMIT_MB = 16384


def test_atheris_harness(tmp_path: Path) -> None:
    """tests/fuzz_atheris.py (libFuzzer-guided bytes) for ATHERIS_RUNS inputs."""
    require_module("atheris", "test")
    harness = Path(__file__).with_name("fuzz_atheris.py")
    done = subprocess.run(
        [
            sys.executable,
            str(harness),
            f"-runs={ATHERIS_RUNS}",
            "-seed=1",
            "-max_len=4096",
            f"-rss_limit_mb={ATHERIS_RSS_LIMIT_MB}",
            f"-artifact_prefix={tmp_path}/",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
