"""What a request may name: ids of printable characters only, disjoint memory regions, and
callers whose certificates carry a name."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from broker_helpers import hybrid, register_request
from fuzz_support import LiveBroker

from broker import convert, wire
from broker.auth import Authenticator
from broker.errors import InvalidFieldError, UnauthenticatedError
from broker.v1 import broker_pb2 as pb
from broker.v1 import broker_pb2_grpc as pb_grpc
from harness.scenarios import build_scenario

SCENARIO = build_scenario(hybrid(), 1, 1, 100)
BAD = grpc.StatusCode.INVALID_ARGUMENT
#: Characters an id may not hold, one per refused kind.
REFUSED = {
    "newline": "\n",
    "escape": "\x1b",
    "delete": "\x7f",
    "next line (C1)": "\x85",
    "line separator": "\u2028",
    "paragraph separator": "\u2029",
    "right-to-left override": "\u202e",
    "left-to-right isolate": "\u2066",
    "zero width space": "\u200b",
    "zero width joiner": "\u200d",
    "byte order mark": "\ufeff",
    "soft hyphen": "\xad",
    "no-break space": "\xa0",
    "ideographic space": "\u3000",
    "tab": "\t",
    "surrogate": "\ud800",
    "private use": "\ue000",
    "unassigned": "\U000e0080",
    "tag character": "\U000e0041",
}
#: Ids real engines use.
ACCEPTED = ("prefill-0", "decode.rank1", "llama-3.1:8b/tp2@v1", "décodeur-1", "引擎 0", "a b")


@pytest.mark.parametrize("char", REFUSED.values(), ids=REFUSED.keys())
def test_ids_refuse_invisible_and_control_characters(char: str) -> None:
    with pytest.raises(InvalidFieldError) as err:
        wire.ident(f"engine{char}0", "engine_id")
    assert err.value.field == "engine_id"
    assert f"U+{ord(char):04X}" in err.value.detail and "at 6" in err.value.detail


@pytest.mark.parametrize("value", ACCEPTED)
def test_ids_of_any_script_pass(value: str) -> None:
    assert wire.ident(value, "engine_id") == value


# --------------------------------------------------------------------------- data parallelism


@pytest.mark.parametrize(
    "engine_id", ["decode-0", "decode-0_dp0", "decode-0_dp1", "decode-0_dp10", "decode-0_dp1023"]
)
def test_a_name_stands_for_its_engine_and_the_data_parallel_ranks_vllm_derives(
    engine_id: str,
) -> None:
    assert wire.names_engine({"decode-0"}, engine_id)
    assert wire.names_engine(frozenset({"ops", "decode-0"}), engine_id)


#: Engine ids ``decode-0`` must not stand for: not vLLM's ``_dp<N>`` of it.
NOT_DATA_PARALLEL_RANKS = (
    "decode-0_dp",  # no rank
    "decode-0_dp1_dp2",  # rank 2 of decode-0_dp1
    "decode-0_dpa",
    "decode-0_dp01",  # not canonical: one rank, one engine id
    "decode-0_dp00",
    "decode-0_dp-1",
    "decode-0_dp+1",
    "decode-0_dp 1",
    "decode-0_dp1 ",
    "decode-0_dp1\n",
    "decode-0_dp\u0661",  # ARABIC-INDIC DIGIT ONE: str.isdigit, int() accepts it
    "decode-0_dp\u00b2",  # SUPERSCRIPT TWO
    "decode-0_dp1024",  # beyond MAX_DATA_PARALLEL_RANKS
    "decode-0_dp99999999999999999999",
    "decode-0_DP0",
    "decode-0dp0",
    "decode-0y_dp0",  # another deployment that starts with the name
    "decode-_dp0",
    "xdecode-0_dp0",
    "decode-1",
)


@pytest.mark.parametrize("engine_id", NOT_DATA_PARALLEL_RANKS)
def test_a_name_stands_for_nothing_else(engine_id: str) -> None:
    assert not wire.names_engine({"decode-0"}, engine_id)


def test_the_deployment_of_a_data_parallel_rank_is_its_last_suffix_removed() -> None:
    assert wire.data_parallel_deployment("decode-0_dp3") == "decode-0"
    assert wire.data_parallel_deployment("decode-0_dp1_dp2") == "decode-0_dp1"
    assert wire.data_parallel_deployment(f"x_dp{wire.MAX_DATA_PARALLEL_RANKS - 1}") == "x"
    for engine_id in ("decode-0", "_dp0", f"x_dp{wire.MAX_DATA_PARALLEL_RANKS}"):
        assert wire.data_parallel_deployment(engine_id) == ""
    assert not wire.names_engine({""}, "_dp0")  # an empty name stands for nothing


@pytest.fixture(scope="module")
def stub() -> Iterator[pb_grpc.BrokerStub]:
    broker = LiveBroker()
    try:
        yield pb_grpc.BrokerStub(broker.channel)
    finally:
        broker.stop()


def expect_invalid(call, request, field: str) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=10)
    assert err.value.code() == BAD, err.value.details()
    assert err.value.details().startswith(f"{field}: "), err.value.details()
    return err.value.details()


def register(engine_id: str = "P") -> pb.RegisterRankRequest:
    return register_request(SCENARIO.prefill, engine_id, pb.ROLE_PREFILL, 0)


def publish(transfer_id: str, **fields: object) -> pb.PublishBlocksRequest:
    request = pb.PublishBlocksRequest(
        transfer_id=transfer_id,
        engine_id="P",
        block_ids=[pb.BlockIds(ids=g) for g in SCENARIO.request.prefill_block_ids],
        num_tokens=SCENARIO.request.num_tokens,
    )
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(request, name).extend(value)
        else:
            setattr(request, name, value)
    return request


def test_every_id_field_refuses_them_over_grpc(stub: pb_grpc.BrokerStub) -> None:
    assert stub.RegisterRank(register(), timeout=10).lease_id
    request = register("P\u202e")
    assert "U+202E" in expect_invalid(stub.RegisterRank, request, "engine_id")
    for name, value in (("agent_name", "agent\u2028x"), ("model_fingerprint", "m\u200b")):
        request = register()
        setattr(request, name, value)
        expect_invalid(stub.RegisterRank, request, name)
    request = register()
    request.layout.groups[0].layers[0] = "layer\u2066.0"
    expect_invalid(stub.RegisterRank, request, "layout.groups[0].layers[0]")
    request = register()
    request.layout.groups[0].segments[0].tensor = "conv\ufeff"
    expect_invalid(stub.RegisterRank, request, "layout.groups[0].segments[0].tensor")
    expect_invalid(stub.PublishBlocks, publish("t\u2029"), "transfer_id")
    expect_invalid(
        stub.PublishBlocks,
        publish("t1", allowed_decode_engines=["D", "D\xa0"]),
        "allowed_decode_engines[1]",
    )
    expect_invalid(stub.KeepAlive, pb.KeepAliveRequest(lease_id="l\u200d"), "lease_id")
    expect_invalid(
        stub.ReportTransfer, pb.ReportTransferRequest(plan_id="p\x85", engine_id="D"), "plan_id"
    )
    expect_invalid(stub.GetTransfer, pb.GetTransferRequest(transfer_id="t\u202e1"), "transfer_id")
    assert stub.PublishBlocks(publish("décodé 1"), timeout=10).expires_at_ms  # printable: fine


# --------------------------------------------------------------------------- regions


def overlapping(index: int, base_of: int, shift: int = 8) -> pb.RegisterRankRequest:
    """The registration with region ``index`` moved to ``shift`` bytes into ``base_of``."""
    request = register()
    request.regions[index].base_addr = request.regions[base_of].base_addr + shift
    return request


def test_overlapping_regions_are_refused_naming_the_later_one(stub: pb_grpc.BrokerStub) -> None:
    detail = expect_invalid(stub.RegisterRank, overlapping(1, 0), "regions[1]")
    assert "overlap regions[0] on dram device 0" in detail
    expect_invalid(stub.RegisterRank, overlapping(0, 1), "regions[1]")  # the later index
    same = register()
    same.regions[1].CopyFrom(same.regions[0])
    expect_invalid(stub.RegisterRank, same, "regions[1]")
    last_byte = register()
    last_byte.regions[1].base_addr = (
        last_byte.regions[0].base_addr + last_byte.regions[0].length_bytes - 1
    )
    expect_invalid(stub.RegisterRank, last_byte, "regions[1]")


def test_regions_that_touch_or_sit_on_other_devices_pass() -> None:
    touching = register()
    touching.regions[1].base_addr = touching.regions[0].base_addr + touching.regions[0].length_bytes
    assert convert.registration_from_proto(touching).regions[1].base_addr == (
        touching.regions[1].base_addr
    )
    other_device = overlapping(1, 0, shift=0)
    other_device.regions[1].device_id = 7
    assert convert.registration_from_proto(other_device).regions[1].device_id == 7


# --------------------------------------------------------------------------- certificate names


class Context:
    """The parts of a ``grpc.aio.ServicerContext`` that authentication reads."""

    def __init__(self, auth: dict[str, list[bytes]], metadata=()) -> None:
        self.auth, self.metadata = auth, tuple(metadata)

    def auth_context(self) -> dict[str, list[bytes]]:
        return self.auth

    def invocation_metadata(self):
        return self.metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5555"


@pytest.mark.parametrize(
    "auth",
    [
        {},
        {"x509_common_name": [b""]},
        {"x509_common_name": [b""], "x509_subject_alternative_name": [b"", b"  "]},
        {"x509_subject_alternative_name": [b"\xff\xfe"]},
    ],
    ids=["no names", "empty common name", "only empty names", "undecodable name"],
)
def test_a_certificate_without_a_usable_name_is_unauthenticated(auth: dict) -> None:
    with pytest.raises(UnauthenticatedError) as err:
        Authenticator(certificates=True, tokens=None).identify(Context(auth))
    assert err.value.field == "authorization"


def test_certificate_names_are_kept_and_empty_ones_dropped() -> None:
    context = Context({"x509_common_name": [b"prefill"], "x509_subject_alternative_name": [b""]})
    who = Authenticator(certificates=True, tokens=None).identify(context)
    assert who.names == frozenset({"prefill"})
