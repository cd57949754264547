"""The pipe from the broker's span tracer to its exporter child: what crosses it, and how.

An ended span crosses as a :data:`PackedSpan`, one flat tuple of plain values, serialized the
moment it ends (marshal; pickle where marshal does not take a value). :class:`SpanPipe`
starts the child (``python -m broker.span_exporter NAMES RESOURCE_JSON``: the exporter names
and the resource attributes), queues the serialized spans and, from a daemon thread, writes
them to the child's stdin as frames: a 4-byte little-endian length, then a pickled list of
serialized spans. :func:`read_frames` is the child's end.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import logging
import marshal
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

log = logging.getLogger(__name__)
_FRAME = struct.Struct("<I")
_PICKLE_PROTO = pickle.PROTO[0]  # the first byte of a pickle; never of a marshalled tuple
#: The module the child runs (``python -m``).
EXPORTER_MODULE = "broker.span_exporter"
#: The pipe to the child, where Linux lets a pipe be this large (default: 64 KiB). The
#: shipping thread writes what fits each ``interval_s``: 64 KiB would cap the export at
#: ~1,000 spans a second.
PIPE_BYTES = 1 << 20

#: A span event: ``(name, time_ns, attributes)``.
PackedEvent = tuple[str, int, dict[str, Any]]
#: A span link: ``(trace_id, span_id, is_remote, attributes)``.
PackedLink = tuple[int, int, bool, dict[str, Any]]
#: What an ended span queues: ``(name, trace_id, span_id, parent_span_id (0: a root),
#: parent_is_remote, kind, start_ns, end_ns, attributes, events, links, status_code,
#: status_description, (scope_name, scope_version))``, with ``kind`` and ``status_code`` the
#: values of OpenTelemetry's enums. Only sampled spans are queued.
PackedSpan = tuple[
    str,
    int,
    int,
    int,
    bool,
    int,
    int,
    int,
    dict[str, Any],
    list[PackedEvent],
    list[PackedLink] | tuple[PackedLink, ...],
    int,
    str | None,
    tuple[str, str | None],
]


class SpanPipe:
    """Packed spans on their way to a ``python -m broker.span_exporter`` child, which
    exports them with the exporters ``exporter_names`` (comma-separated, see
    :data:`broker.tracing.EXPORTERS`) in a resource of ``resource_attributes``.

    Ended spans queue up as bytes (:meth:`put`); every ``interval_s`` a daemon thread frames
    them and writes what the pipe takes without blocking. Frames the child has not read yet
    wait too (bytes: a slow child costs no garbage-collector work), at most ``max_pending``
    spans' worth: beyond that the oldest whole frames are dropped and counted in
    :attr:`dropped`. :meth:`close` writes the rest, closes the child's stdin and waits for it
    to export and exit; it also runs at exit.
    """

    def __init__(
        self,
        exporter_names: str,
        resource_attributes: Mapping[str, Any],
        interval_s: float = 0.2,
        max_pending: int = 65536,
    ) -> None:
        self.max_pending = max_pending
        self.dropped = 0
        self._queue: deque[bytes] = deque()  # packed spans, serialized
        self._frames: deque[tuple[memoryview, int]] = deque()  # unwritten bytes, spans
        self._pending = 0  # spans in self._frames
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # one writer of the pipe at a time
        command = [sys.executable, "-m", EXPORTER_MODULE, exporter_names]
        self._child = subprocess.Popen(
            [*command, json.dumps(dict(resource_attributes))], stdin=subprocess.PIPE
        )
        assert self._child.stdin is not None
        self._fd = self._child.stdin.fileno()
        os.set_blocking(self._fd, False)
        if hasattr(fcntl, "F_SETPIPE_SZ"):
            try:
                fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            except OSError:  # beyond /proc/sys/fs/pipe-max-size: keep the default
                pass
        self._thread = threading.Thread(target=self._ship, name="pdbroker-spans", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    @property
    def child_pid(self) -> int:
        """The exporter child's process id."""
        return self._child.pid

    @property
    def shipping_thread_id(self) -> int | None:
        """The native id of the thread that writes frames (None before it started)."""
        return self._thread.native_id

    def put(self, packed: PackedSpan) -> None:
        """Queue one ended span (the shipping thread takes it within ``interval_s``), as bytes
        at once: then its dicts and lists die now rather than wait in the queue, where the
        garbage collector would move them to older generations and run full collections
        more often."""
        try:
            data = marshal.dumps(packed)
        except ValueError:  # a value marshal does not take (a subclass of str or int...)
            data = pickle.dumps(packed, pickle.HIGHEST_PROTOCOL)
        self._queue.append(data)

    def _ship(self) -> None:
        while not self._stopping.wait(self._interval_s):
            self._send()

    def _send(self) -> None:
        """Frame what has queued up, drop the oldest frames beyond ``max_pending`` spans,
        write what the pipe takes now."""
        with self._lock:
            batch = [self._queue.popleft() for _ in range(len(self._queue))]
            if batch:
                payload = pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)
                self._frames.append((memoryview(_FRAME.pack(len(payload)) + payload), len(batch)))
                self._pending += len(batch)
            while self._pending > self.max_pending and len(self._frames) > 1:
                _, spans = self._frames.popleft()  # never the head: it may be half written
                self._pending -= spans
                self.dropped += spans
            self._write()

    def _write(self) -> None:
        while self._frames and self._fd >= 0:
            data, spans = self._frames[0]
            try:
                written = os.write(self._fd, data)
            except BlockingIOError:
                return
            except OSError:  # the child is gone
                self.dropped += self._pending
                self._frames.clear()
                self._pending = 0
                log.warning(
                    "span exporter process exited (code %s); spans are dropped",
                    self._child.poll(),
                )
                return
            if written < len(data):
                self._frames[0] = (data[written:], spans)
            else:
                self._frames.popleft()
                self._pending -= spans

    def flush(self) -> bool:
        """Hand the queued spans to the child as far as its pipe takes them now; whether
        it took them all."""
        self._send()
        return not self._frames

    def close(self) -> None:
        """Write the rest, let the child export it and exit (waits up to 30 s). Later calls
        do nothing."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._thread.join()
        os.set_blocking(self._fd, True)
        self._send()
        if self._child.stdin is not None:
            self._child.stdin.close()
        self._fd = -1
        try:
            self._child.wait(30)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()
        if self.dropped:
            log.warning("%d spans were dropped", self.dropped)


def read_frames(stream: BinaryIO) -> Iterator[list[PackedSpan]]:
    """The child's end: frames until the stream ends; a frame cut short (the broker died
    writing it) ends it too."""
    while len(header := stream.read(_FRAME.size)) == _FRAME.size:
        (size,) = _FRAME.unpack(header)
        payload = stream.read(size)
        if len(payload) < size:
            log.warning("the broker went away in the middle of a frame")
            return
        yield [
            pickle.loads(s) if s[0] == _PICKLE_PROTO else marshal.loads(s)
            for s in pickle.loads(payload)
        ]
