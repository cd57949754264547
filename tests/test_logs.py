"""Log lines cannot be forged (one event, one line) and secrets stay out of them."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest

from broker.logs import JsonFormatter, TextFormatter, TransferFilter, escape, transfer_fields
from broker.store.redis_link import redact_url

#: A caller-supplied text that tries to start a line of its own, rewrite the terminal and
#: reorder what is shown.
FORGED = (
    "disk full\n2026-01-01 00:00:00,000 INFO broker.service: completed\r"
    "\x1b[2K\x1b[31mred\x1b[0m\u2028next\u2029para\u202eesrever\u200bzero\ufefftab\there"
    "\x85nel\x00nul\x7fdel\U000e0001tag"
)
#: Characters that must never reach a log line raw.
RAW = set("\n\r\x1b\u2028\u2029\u202e\u200b\ufeff\t\x85\x00\x7f\U000e0001")


def emit(formatter: logging.Formatter, message: str, *args: object, **kwargs) -> str:
    """What a handler with ``formatter`` writes for one record of logger ``test``."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(TransferFilter())
    handler.setFormatter(formatter)
    logger = logging.getLogger("test.logs")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning(message, *args, **kwargs)
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    return stream.getvalue()


@pytest.fixture
def failure() -> Iterator[tuple]:
    try:
        raise RuntimeError(f"report failed: {FORGED}")
    except RuntimeError:
        yield sys.exc_info()


def test_escape_writes_every_non_printable_character_as_an_escape() -> None:
    assert escape("prefill-0 décodeur ✓") == "prefill-0 décodeur ✓"
    assert escape("a\nb\rc\td\x1b\u2028\u202e\u200b\x85\U000e0001") == (
        "a\\nb\\rc\\td\\x1b\\u2028\\u202e\\u200b\\x85\\U000e0001"
    )
    assert not RAW & set(escape(FORGED))


def test_text_format_writes_one_line_per_event() -> None:
    line = emit(TextFormatter(), "aborted: %s", FORGED, extra=transfer_fields("t\n1", ""))
    assert line.endswith("\n") and line.count("\n") == 1, line
    assert not RAW & set(line[:-1])
    assert "aborted: disk full\\n2026-01-01 00:00:00,000 INFO" in line
    assert "\\x1b[31mred\\x1b[0m\\u2028next\\u2029para\\u202eesrever\\u200bzero" in line
    assert line.rstrip("\n").endswith(" transfer=t\\n1")


def test_text_format_keeps_a_traceback_below_its_escaped_line(failure: tuple) -> None:
    out = emit(TextFormatter(), "internal error: %s", FORGED, exc_info=failure,
               extra=transfer_fields("t1", ""))  # fmt: skip
    head, *traceback = out.rstrip("\n").split("\n")
    assert head.endswith(" transfer=t1") and "internal error: disk full\\n2026" in head
    assert traceback[0] == "Traceback (most recent call last):"
    assert traceback[-1].startswith("RuntimeError: report failed: disk full\\n2026-01-01")
    assert not RAW & set(out.replace("\n", "")), out


def test_json_format_is_one_line_that_round_trips(failure: tuple) -> None:
    out = emit(JsonFormatter(), "aborted: %s", FORGED, exc_info=failure,
               extra=transfer_fields("t1", ""))  # fmt: skip
    assert out.endswith("\n") and out.count("\n") == 1
    assert out[:-1].isascii() and out[:-1].isprintable()
    record = json.loads(out)
    assert record["message"] == f"aborted: {FORGED}"
    assert record["transfer_id"] == "t1"
    assert record["exc"].endswith(f"RuntimeError: report failed: {FORGED}")


@pytest.mark.parametrize(
    "url,shown",
    [
        ("redis://:s3cret-pw@redis:6379/0", "redis://:***@redis:6379/0"),
        ("rediss://pdbroker:s3cret-pw@redis:6380/1", "rediss://pdbroker:***@redis:6380/1"),
        ("redis://s3cret-pw@redis/0", "redis://***@redis/0"),
        ("redis://:s3cret@pw/with?odd#chars@redis:6379/0", "redis://:***@redis:6379/0"),
        ("unix://:s3cret-pw@/run/redis.sock?db=2", "unix://:***@/run/redis.sock?db=2"),
        ("redis://redis:6379/0?db=1&password=s3cret-pw", "redis://redis:6379/0?db=1&password=***"),
        ("redis://redis:6379/0", "redis://redis:6379/0"),
    ],
)
def test_store_urls_are_shown_without_their_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "s3cret" not in redact_url(url)
