"""``kv_connector_extra_config`` parsing: NixlConnector's ``backends`` and ``num_threads`` keep
their meaning, batched broker calls are on unless turned off, and bad values fail start-up
naming the key."""

from __future__ import annotations

from typing import Any

import pytest
import vllm_engines  # noqa: F401 - configures vLLM for CPU, skips this module without vLLM

# isort: split
from clients.vllm.metadata import ConnectorSettings

BROKER = {"broker": "127.0.0.1:50151"}


def settings(**extra: Any) -> ConnectorSettings:
    return ConnectorSettings.from_extra_config({**BROKER, **extra})


def test_defaults_are_ucx_with_nixls_own_thread_setting() -> None:
    default = settings()
    assert (default.backends, default.num_threads, default.nixl_params()) == (("UCX",), 0, None)


def test_nixl_connector_keys_keep_their_meaning() -> None:
    """As in NixlConnector: ``num_threads`` sets UCX's threads when the backends are UCX
    alone; other backends are created with NIXL's defaults."""
    ucx = settings(backends=["UCX"], num_threads=8)
    assert ucx.backends == ("UCX",) and ucx.nixl_params() == {"num_threads": "8"}
    efa = settings(backends=["LIBFABRIC"], num_threads=8)
    assert efa.backends == ("LIBFABRIC",) and efa.nixl_params() is None
    assert settings(backends=["UCX", "GDS"], num_threads=8).nixl_params() is None
    assert settings(num_threads="4").num_threads == 4  # JSON written as a string


def test_batched_calls_are_the_default_and_can_be_turned_off() -> None:
    assert settings().batch_calls is True
    assert settings(batch_calls=False).batch_calls is False
    assert settings(batch_calls="False").batch_calls is False  # JSON written as a string
    assert settings(batch_calls="true").batch_calls is True


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"backends": "UCX"}, r"^kv_connector_extra_config\.backends: a list"),
        ({"backends": []}, r"^kv_connector_extra_config\.backends: a list"),
        ({"backends": ["UCX", ""]}, r"^kv_connector_extra_config\.backends: a list"),
        ({"backends": ["UCX", 1]}, r"^kv_connector_extra_config\.backends: a list"),
        ({"backends": ["UCX", "UCX"]}, r"^kv_connector_extra_config\.backends: a list"),
        ({"num_threads": -1}, r"^kv_connector_extra_config\.num_threads: must be 0 or more"),
        ({"num_threads": "many"}, r"^kv_connector_extra_config\.num_threads: 'many' is not"),
        ({"read_timeout_s": [1]}, r"^kv_connector_extra_config\.read_timeout_s: \[1\] is not"),
        ({"batch_calls": "no"}, r"^kv_connector_extra_config\.batch_calls: 'no' is not a bool"),
        ({"batch_calls": 0}, r"^kv_connector_extra_config\.batch_calls: 0 is not a bool"),
        ({"nixl_backends": ["UCX"]}, r"unknown keys \['nixl_backends'\]"),
    ],
)
def test_bad_values_name_their_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings(**extra)
