"""Value types of the commands' options: each refuses a bad value with
``argparse.ArgumentTypeError``, which the parser reports as a usage error naming the flag."""

from __future__ import annotations

import argparse
from argparse import ArgumentTypeError
from collections.abc import Callable
from typing import TypeVar

from broker.errors import UsageError

T = TypeVar("T")

MAX_PORT = 65_535


def _integer(text: str, lowest: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ArgumentTypeError(f"{text!r} is not {what}") from None
    if value < lowest:
        raise ArgumentTypeError(f"{text!r} is not {what}")
    return value


def positive_int(text: str) -> int:
    return _integer(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _integer(text, 0, "an integer >= 0")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of positive integers."""
    values = [positive_int(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise ArgumentTypeError(f"{text!r} names no count")
    return values


def port(text: str) -> int:
    """A TCP port to listen on: 0 (pick a free one) to 65535."""
    value = _integer(text, 0, f"a port (0-{MAX_PORT})")
    if value > MAX_PORT:
        raise ArgumentTypeError(f"{text!r} is not a port (0-{MAX_PORT})")
    return value


def _address(text: str, lowest_port: int) -> str:
    host, colon, port_text = text.rpartition(":")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not colon or not bare:
        raise ArgumentTypeError(f"{text!r} is not HOST:PORT")
    if ":" in bare and bare == host:
        raise ArgumentTypeError(f"{text!r}: an IPv6 host goes in brackets, [{host}]:PORT")
    if any(c.isspace() for c in host) or "/" in host:
        raise ArgumentTypeError(f"{text!r}: {host!r} is not a host name or address")
    if not port_text.isdigit() or not lowest_port <= int(port_text) <= MAX_PORT:
        raise ArgumentTypeError(f"{text!r}: the port is not a number in {lowest_port}-{MAX_PORT}")
    return text


def listen_address(text: str) -> str:
    """``HOST:PORT`` to listen on; port 0 picks a free one."""
    return _address(text, 0)


def broker_address(text: str) -> str:
    """``HOST:PORT`` of a running broker."""
    return _address(text, 1)


def broker_addresses(text: str) -> list[str]:
    """Comma-separated ``HOST:PORT`` of running brokers."""
    addresses = [broker_address(part.strip()) for part in text.split(",") if part.strip()]
    if not addresses:
        raise ArgumentTypeError(f"{text!r} names no broker")
    return addresses


def from_environment(flag: str, name: str, raw: str, parse: Callable[[str], T]) -> T:
    """``parse(raw)``, ``raw`` the value of environment variable ``name`` standing in for
    ``flag``; a refusal is a :class:`UsageError` naming both."""
    try:
        return parse(raw)
    except ArgumentTypeError as exc:
        raise UsageError(flag, f"{name}={exc}") from None


def add_cache_options(parser: argparse.ArgumentParser, block_size_help: str) -> None:
    """``--block-size``, ``--kernel-block-size``, ``--kv-dtype`` and ``--json``: how the
    caches a command lays out are cut, and its output."""
    parser.add_argument("--block-size", type=non_negative_int, default=0, help=block_size_help)
    parser.add_argument(
        "--kernel-block-size",
        type=non_negative_int,
        default=0,
        help="tokens per attention kernel block; 0: the block size",
    )
    parser.add_argument(
        "--kv-dtype", help="KV-cache dtype, e.g. bfloat16 or fp8 (default: the model's)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
