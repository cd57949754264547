"""Structured logs: every line about a transfer carries its transfer id and trace id.

Code that logs about a transfer passes ``extra=transfer_fields(transfer_id, traceparent)``;
:class:`TransferFilter` fills a missing trace id from the current span. Two formats: text
(``... message transfer=ID trace=HEX``) and JSON lines (one object per record with ``ts``,
``level``, ``logger``, ``message``, ``transfer_id``, ``trace_id``, ``span_id``, ``exc``),
chosen by ``--log-format`` or ``PDBROKER_LOG_FORMAT``.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime, timezone

from opentelemetry import trace

from broker.tracing import trace_id_of

FORMATS = ("text", "json")
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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
    """The usual text line, then `` transfer=ID trace=HEX`` when the record has them."""

    def __init__(self) -> None:
        super().__init__(_TEXT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        tags = [
            f"{key}={value}"
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


class JsonFormatter(logging.Formatter):
    """One JSON object per record; empty ids are left out."""

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
