"""What native libraries (gRPC's C core) write to the process's stderr, held back while a
command tries something whose failure it reports in its own one line."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def native_log_held() -> Iterator[list[str]]:
    """Hold back what is written to file descriptor 2 inside the block; the yielded list
    then holds it, as one string, for the caller to show or drop."""
    held: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield held
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            held.append(sink.read().decode(errors="replace"))
