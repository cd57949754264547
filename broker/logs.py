"""Structured logs: every line about a transfer carries its transfer id and trace id.

Code that logs about a transfer passes ``extra=transfer_fields(transfer_id, traceparent)``;
:class:`TransferFilter` fills a missing trace id from the current span. Two formats: text
(``... message transfer=ID trace=HEX``) and JSON lines (one object per record with ``ts``,
``level``, ``logger``, ``message``, ``transfer_id``, ``trace_id``, ``span_id``, ``exc``),
chosen by ``--log-format`` or ``PDBROKER_LOG_FORMAT``.

One event is one line in either format: text escapes every non-printable character of the
message and the ids (newlines, carriage returns, ANSI escapes, U+2028, bidi controls) as
``\\n``, ``\\x1b``, ``\\u2028``; JSON escapes them through ``json.dumps``. Only a traceback
follows on lines of its own, below its event's line.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from datetime import datetime, timezone
from types import TracebackType

from opentelemetry import trace

from broker.tracing import trace_id_of

#: What ``sys.exc_info()`` returns, as :meth:`logging.Formatter.formatException` takes it.
_ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None] | tuple[None, None, None]

FORMATS = ("text", "json")
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape(text: str) -> str:
    """``text`` with every non-printable character (``str.isprintable``: controls, format
    characters, line and paragraph separators, spaces other than ' ') as a Python escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape_char(c) for c in text)


def _escape_char(c: str) -> str:
    code = ord(c)
    if c in _ESCAPES:
        return _ESCAPES[c]
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def transfer_fields(transfer_id: str, traceparent: str = "") -> dict[str, str]:
    """``extra=`` of a log call about ``transfer_id`` (in the trace of ``traceparent``)."""
    return {"transfer_id": transfer_id, "trace_id": trace_id_of(traceparent)}


class TransferFilter(logging.Filter):
    """Gives every record ``transfer_id``, ``trace_id`` and ``span_id`` attributes: those
    passed in ``extra``, else the current span's ids (trace id only inside a recording span),
    else ''."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = trace.get_current_span().get_span_context()
        if not hasattr(record, "transfer_id"):
            record.transfer_id = ""
        if not getattr(record, "trace_id", ""):
            record.trace_id = format(context.trace_id, "032x") if context.is_valid else ""
        record.span_id = format(context.span_id, "016x") if context.is_valid else ""
        return True


class TextFormatter(logging.Formatter):
    """The usual text line, then `` transfer=ID trace=HEX`` when the record has them, all of
    it through :func:`escape`; a traceback follows on its own lines, each escaped (and each
    exception's message on the line of its type)."""

    def __init__(self) -> None:
        super().__init__(_TEXT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape(super().formatMessage(record))

    def formatException(self, ei: _ExcInfo) -> str:
        text = super().formatException(ei)
        for message in _messages(ei[1]):  # a message's newlines would start forged lines
            text = text.replace(message, escape(message))
        return "\n".join(escape(line) for line in text.split("\n"))

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        tags = [
            f"{key}={escape(str(value))}"
            for key, value in (
                ("transfer", getattr(record, "transfer_id", "")),
                ("trace", getattr(record, "trace_id", "")),
            )
            if value
        ]
        if not tags:
            return line
        head, newline, tail = line.partition("\n")  # keep a traceback below the tags
        return f"{head} {' '.join(tags)}{newline}{tail}"


def _messages(exc: BaseException | None) -> Iterator[str]:
    """The non-printable messages of ``exc`` and the exceptions it was raised from."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        try:
            message = str(exc)
        except Exception:  # noqa: BLE001 - the traceback then shows what it can
            message = ""
        if not message.isprintable():
            yield message
        exc = exc.__cause__ or exc.__context__


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (``json.dumps`` escapes every control
    character and, keeping to ASCII, U+2028 and U+2029); empty ids are left out."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("transfer_id", "trace_id", "span_id"):
            value = getattr(record, key, "")
            if value:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(level: str | int = "INFO", fmt: str | None = None) -> None:
    """Log to stderr at ``level`` in ``fmt`` (``text`` or ``json``; None reads
    ``PDBROKER_LOG_FORMAT``, default text), replacing the root logger's handlers."""
    fmt = (fmt or os.environ.get("PDBROKER_LOG_FORMAT") or "text").lower()
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {FORMATS}")
    handler = logging.StreamHandler()
    handler.addFilter(TransferFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
