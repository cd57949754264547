"""The command line's conventions: a usage or start-up error is one stderr line naming the
flag, with exit status 2, and ``serve`` announces nothing before it fails; every count, size
and address is validated; ``--version``; every ``--help`` shows the defaults, describes every
option and holds no markup; ``--json`` output is one JSON object. ``serve`` runs as a real
process (``python -m broker.cli``)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from broker import __version__
from broker.cli import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "broker.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": ROOT} | (env or {}),
    )


def one_line_error(done: subprocess.CompletedProcess, command: str, flag: str) -> str:
    """Asserts exit status 2, nothing on stdout and one stderr line naming ``flag``."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.endswith("\n"), done.stderr
    assert done.stderr.startswith(f"pdbroker {command}: error: {flag}: "), done.stderr
    return done.stderr.strip()


@pytest.fixture(scope="module")
def taken_port() -> Iterator[int]:
    """A loopback port another socket listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- serve


@pytest.mark.parametrize(
    "flags,env,flag,why",
    [
        (["--listen", "127.0.0.1"], {}, "--listen", "'127.0.0.1' is not HOST:PORT"),
        (
            ["--listen", "127.0.0.1:99999"],
            {},
            "--listen",
            "'127.0.0.1:99999': the port is not a number in 0-65535",
        ),
        (["--listen", ":50151"], {}, "--listen", "':50151' is not HOST:PORT"),
        (
            ["--listen", "::1:50151"],
            {},
            "--listen",
            "'::1:50151': an IPv6 host goes in brackets, [::1]:PORT",
        ),
        ([], {"PDBROKER_LISTEN": "127.0.0.1"}, "--listen", "PDBROKER_LISTEN='127.0.0.1' is not"),
        (
            ["--log-level", "LOUD"],
            {},
            "--log-level",
            "'LOUD' is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL",
        ),
        ([], {"PDBROKER_LOG_LEVEL": "loud"}, "--log-level", "PDBROKER_LOG_LEVEL='loud' is not"),
        (["--max-ranks", "0"], {}, "--max-ranks", "'0' is not a positive integer"),
        (
            ["--max-session-streams", "0"],
            {},
            "--max-session-streams",
            "'0' is not a positive integer",
        ),
        (["--metrics-port", "65536"], {}, "--metrics-port", "'65536' is not a port (0-65535)"),
        ([], {"PDBROKER_HEALTH_PORT": "-1"}, "--health-port", "PDBROKER_HEALTH_PORT='-1' is not"),
        (["--store", "http://127.0.0.1/0"], {}, "--store", "is neither memory nor redis://"),
    ],
)
def test_serve_refuses_a_malformed_option_in_one_line(
    flags: list[str], env: dict[str, str], flag: str, why: str
) -> None:
    line = one_line_error(run_cli("serve", "--insecure", *flags, env=env), "serve", flag)
    assert why in line


@pytest.mark.parametrize("flag", ["--listen", "--health-port", "--metrics-port"])
def test_serve_refuses_a_port_in_use_in_one_line(taken_port: int, flag: str) -> None:
    """gRPC's own multi-line log of the failed bind is held back; nothing says "serving"
    or "listening" (the insecure warning comes only once every port is bound)."""
    listen = f"127.0.0.1:{taken_port}" if flag == "--listen" else "127.0.0.1:0"
    more = [] if flag == "--listen" else [flag, str(taken_port)]
    line = one_line_error(run_cli("serve", "--insecure", "--listen", listen, *more), "serve", flag)
    assert line.endswith(f"cannot listen on 127.0.0.1:{taken_port}: Address already in use")


def test_serve_refuses_an_unreachable_store_in_one_line() -> None:
    port = closed_port()
    done = run_cli("serve", "--insecure", "--store", f"redis://127.0.0.1:{port}/0")
    assert f"cannot reach redis://127.0.0.1:{port}/0: " in one_line_error(done, "serve", "--store")


# --------------------------------------------------------------------------- every command


def invoke(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``main(args)`` in process: exit status, stdout, stderr."""
    try:
        status = main(list(args))
    except SystemExit as exc:
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize(
    "args,flag",
    [
        (["layout", "--model", "nemotron-h-8b", "--tp", "0"], "--tp"),
        (["layout", "--model", "nemotron-h-8b", "--tp", "-1"], "--tp"),
        (["layout", "--model", "nemotron-h-8b", "--block-size", "-16"], "--block-size"),
        (["plan", "--model", "qwen3.5-0.8b", "--prefill-tp", "0"], "--prefill-tp"),
        (["plan", "--model", "qwen3.5-0.8b", "--decode-tp", "-1"], "--decode-tp"),
        (["plan", "--model", "qwen3.5-0.8b", "--tokens", "0"], "--tokens"),
        (["plan", "--model", "qwen3.5-0.8b", "--kernel-block-size", "x"], "--kernel-block-size"),
        (["demo", "--requests", "0"], "--requests"),
        (["demo", "--inflight", "-2"], "--inflight"),
        (["demo", "--broker", "127.0.0.1"], "--broker"),
        (["demo", "--broker", "127.0.0.1:1,127.0.0.1:0"], "--broker"),
        (["status", "--broker", "127.0.0.1:70000"], "--broker"),
        (["status", "--timeout", "0"], "--timeout"),
        (["status", "--limit", "0"], "--limit"),
        (["transfer", "t1", "--timeout", "nan"], "--timeout"),
        (["bench", "planner", "--iterations", "0"], "--iterations"),
        (["bench", "descriptors", "--tokens", "0"], "--tokens"),
        (["bench", "transfer", "--decode-tp", "0"], "--decode-tp"),
        (["bench", "transfer", "--prefill-device", "-1"], "--prefill-device"),
        (["bench", "control-plane", "--clients", "1,0,4"], "--clients"),
        (["bench", "control-plane", "--seconds", "-3"], "--seconds"),
        (["bench", "control-plane", "--ways", "calls,unary"], "--ways"),
        (["soak", "--prefill-tp", "0"], "--prefill-tp"),
        (["soak", "--seconds", "0"], "--seconds"),
        (["soak", "--prefill-ranks", "3", "--prefill-tp", "2"], "--prefill-ranks"),
        (["soak", "--min-tokens", "512", "--max-tokens", "256"], "--max-tokens"),
        (["soak", "--rate", "-1"], "--rate"),
    ],
)
def test_counts_sizes_and_addresses_are_usage_errors_naming_the_flag(
    capsys: pytest.CaptureFixture[str], args: list[str], flag: str
) -> None:
    status, out, err = invoke(capsys, *args)
    command = " ".join(args[:2]) if args[0] == "bench" else args[0]
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"pdbroker {command}: error: {flag}: "), err


def test_status_refuses_a_malformed_broker_from_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDBROKER_BROKER", "broker")
    assert invoke(capsys, "status") == (
        2,
        "",
        "pdbroker status: error: --broker: PDBROKER_BROKER='broker' is not HOST:PORT\n",
    )


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        expected = importlib.metadata.version("pdbroker")
    except importlib.metadata.PackageNotFoundError:
        expected = __version__
    assert invoke(capsys, "--version") == (0, f"pdbroker {expected}\n", "")


def parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command's parser, by its name (``bench planner``, ...)."""

    def walk(
        parser: argparse.ArgumentParser, name: str
    ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
        subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subcommands:
            yield name, parser
        for action in subcommands:
            for command, sub in action.choices.items():
                yield from walk(sub, f"{name} {command}".strip())

    yield from walk(build_parser(), "")


COMMANDS = [name for name, _ in parsers()]


def test_every_command_is_checked() -> None:
    assert {"serve", "plan", "layout", "demo", "soak", "status", "transfer"} < set(COMMANDS)
    assert {"bench planner", "bench transfer", "bench control-plane"} < set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_every_default_and_no_markup(command: str) -> None:
    parser = dict(parsers())[command]
    text = parser.format_help()
    assert "`" not in text and "``" not in text, text
    flat = " ".join(text.split())
    for action in parser._actions:
        default = action.default
        unset = default is None or default is False or default in ("", argparse.SUPPRESS)
        if action.option_strings and action.help and not unset:  # help: the next test
            shown = ",".join(map(str, default)) if isinstance(default, list) else default
            assert f"(default: {shown})" in flat or f"default: {shown}" in flat, (
                action.option_strings,
                flat,
            )


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_help(command: str) -> None:
    parser = dict(parsers())[command]
    assert [a.dest for a in parser._actions if not a.help] == []


def test_help_states_the_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = invoke(capsys, "--help")
    assert status == 0
    assert "2  a usage or configuration error" in out and "1  a runtime failure" in out


# --------------------------------------------------------------------------- JSON outputs


def test_plan_states_the_request_it_assumed(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "qwen3.5-0.8b", "--prefill-tp", "1", "--decode-tp", "2"]
    status, out, _ = invoke(capsys, *args, "--tokens", "1000", "--json")
    assert status == 0
    plan = json.loads(out)
    request = plan["request"]
    assert request["model"].startswith("qwen3.5-0.8b:")
    assert (request["prefill_tp"], request["decode_tp"], request["tokens"]) == (1, 2, 1000)
    assert (request["block_size"], request["kernel_block_size"]) == (544, 544)
    assert request["kv_dtype"] == "bfloat16"
    assert [(g["kind"], g["prefill_blocks"], g["decode_blocks"]) for g in request["groups"]] == [
        ("mamba", 1, 1),
        ("mamba", 1, 1),
        ("mamba", 1, 1),
        ("attention", 2, 2),  # ceil(1000 / 544)
    ]
    # The runs, as before: 7 columns, one row per descriptor, their lengths the bytes.
    assert all(len(row) == 7 for row in plan["runs"])
    assert len(plan["runs"]) == plan["descriptors"]
    assert sum(row[6] for row in plan["runs"]) == plan["total_bytes"]
    status, out, _ = invoke(capsys, *args, "--tokens", "1000")
    assert status == 0
    assert out.splitlines()[:3] == [
        "request:     1,000 tokens of " + request["model"] + ", prefill TP1 -> decode TP2",
        "blocks:      544 tokens, attention kernel blocks of 544, KV cache bfloat16",
        "block ids:   prefill/decode per group: 3 mamba groups 1/1, 1 attention group 2/2",
    ]
