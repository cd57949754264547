"""What the long commands (``soak``, ``bench``) say on stderr while they run, and how much of
their libraries' logging reaches it. Nothing here writes to stdout, which carries the result."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import warnings
from types import TracebackType
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from typing_extensions import Self

#: Libraries whose logs below ERROR and whose Python warnings only ``--verbose`` shows.
LIBRARIES = ("torch", "vllm", "transformers")
#: Columns of a status line when the terminal does not say.
DEFAULT_COLUMNS = 80


def quiet_libraries(verbose: bool) -> None:
    """Set before torch or vLLM is imported. Quiet: their logs below ERROR and their Python
    warnings are dropped (processes started later inherit the environment part: torch's
    ``TORCH_LOGS``, vLLM's ``VLLM_LOGGING_LEVEL``, unless already set). Verbose: log records
    of INFO and up, theirs and ours, reach stderr."""
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        return
    os.environ.setdefault("TORCH_LOGS", "-all")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in LIBRARIES:
        # vLLM leaves its loggers unconfigured in-process: its records reach Python's
        # last-resort handler unless their own logger drops them.
        logging.getLogger(name).setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", module=rf"{name}(\.|$)")


class Progress:
    """A command's status on ``stream`` (stderr): on a terminal one line rewritten in place
    and cleared at the end; otherwise a plain line for every phase and, between phases, at
    most one update every ``interval_s``. Each line names the command and the seconds since
    it started."""

    def __init__(self, command: str, stream: TextIO | None = None, interval_s: float = 5.0):
        self.command = command
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.interval_s = interval_s
        self.started = time.monotonic()
        self._shown_at = -math.inf
        self._on_screen = False

    def phase(self, text: str) -> None:
        """A new step of the run: always shown."""
        self._show(text)

    def update(self, text: str) -> None:
        """Where the current step stands: shown on a terminal, else now and then."""
        if self.tty or time.monotonic() - self._shown_at >= self.interval_s:
            self._show(text)

    def close(self) -> None:
        """Clear the status line of a terminal (a plain stream keeps its lines), so that
        what the command prints next starts on a clean line."""
        if self._on_screen:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._on_screen = False

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def _show(self, text: str) -> None:
        now = time.monotonic()
        line = f"{self.command} [{now - self.started:.0f} s] {text}"
        if self.tty:
            self.stream.write(f"\r\x1b[K{line[: self._columns() - 1]}")
            self._on_screen = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._shown_at = now

    def _columns(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns
        except (OSError, ValueError):
            return DEFAULT_COLUMNS
