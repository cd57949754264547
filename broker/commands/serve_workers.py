"""``pdbroker serve --workers N``: N broker processes serving one port, all on the Redis store.

Each worker is a whole broker (:func:`~broker.commands.serve.serve_process`): its own
service, gRPC server, event loop, store connections and release subscription. They bind the
port with ``SO_REUSEPORT``, so the kernel spreads incoming connections over them; the store
makes them one broker, as it does replicas (a release committed on one wakes the watchers of
every other). The health port is shared the same way; metrics are per process, so
``--metrics-port P`` gives worker *k* (from 1) port P+k-1 (0: each picks its own).

:class:`Supervisor`, this process: it checks that the ports are free (nothing listens there,
not even another broker's workers; port 0 picks one, for every worker to bind), forks the
workers after the options are parsed, and waits until each has bound every port or said why
it cannot: then it stops the others and fails with that one line. Once all serve, it
announces them (a line per worker, the health port, ``listening on`` last) and supervises:
SIGTERM or SIGINT is passed on to every worker, and it exits once they have stopped, 0 when
all stopped cleanly. A worker that dies otherwise is started again after
:data:`RESTART_DELAY_S` (its clients reconnect to the others meanwhile), unless
:data:`MAX_RESTARTS` restarts happened within :data:`RESTART_WINDOW_S`: then every worker is
stopped and the supervisor exits 1, for whatever supervises it to see. A worker gets SIGTERM
when the supervisor dies (Linux).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import logging
import os
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from types import FrameType
from typing import TYPE_CHECKING

from broker.commands.options import MAX_PORT
from broker.commands.serve import serve_process
from broker.commands.serve_announce import Bound, announce_serving
from broker.errors import UsageError

if TYPE_CHECKING:
    from broker.server_security import ServerSecurity

log = logging.getLogger("broker.serve")

#: Pause before a worker that died is started again (seconds).
RESTART_DELAY_S = 0.5
#: Restarts within RESTART_WINDOW_S seconds after which the supervisor gives up.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: prctl(2) option: the signal this process gets when its parent dies.
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Worker:
    """Worker ``index`` (from 1), process ``pid``."""

    index: int
    pid: int


class Supervisor:
    """Runs ``args.workers`` workers of the ``serve`` options ``args`` (see the module);
    ``announce`` prints a start-up line."""

    def __init__(
        self,
        args: argparse.Namespace,
        security: ServerSecurity,
        announce: Callable[[str], None],
    ) -> None:
        self.args = args
        self.security = security
        self.announce = announce
        self.workers: dict[int, Worker] = {}  # by pid
        self.stopping = False
        self._restarts: deque[float] = deque()

    def run(self) -> int:
        """Start the workers, announce them, supervise them until stopped; the exit status.
        :class:`UsageError` when a worker cannot start."""
        self._fix_ports()
        for sig in _SIGNALS:
            signal.signal(sig, self._stop)
        started = [self._fork(index) for index in range(1, self.args.workers + 1)]
        reports = [(worker, self._report(worker, fd)) for worker, fd in started]
        serving = [(worker, r) for worker, r in reports if isinstance(r, Bound)]
        if len(serving) < len(reports) or self.stopping:
            self._signal_all(signal.SIGTERM)
            self._wait_all()
            for _, report in reports:
                if isinstance(report, UsageError) and not self.stopping:
                    raise report
            return 0
        lines = [_worker_line(worker, bound) for worker, bound in serving]
        announce_serving(serving[0][1], self.security, self.announce, lines)
        return self._supervise()

    def _fix_ports(self) -> None:
        """Check that the port and the health port are free, each picked where 0, so that
        every worker binds the same; check that every worker's metrics port exists."""
        host = self.args.listen.rsplit(":", 1)[0].strip("[]")
        port = _free_port(host, int(self.args.listen.rsplit(":", 1)[1]), "--listen")
        self.args.listen = f"{self.args.listen.rsplit(':', 1)[0]}:{port}"
        if self.args.health_port is not None:
            self.args.health_port = _free_port(host, self.args.health_port, "--health-port")
        last = (self.args.metrics_port or 0) + self.args.workers - 1
        if self.args.metrics_port and last > MAX_PORT:
            raise UsageError(
                "--metrics-port",
                f"{self.args.workers} workers need ports {self.args.metrics_port}-{last}, past "
                f"{MAX_PORT}",
            )

    def _fork(self, index: int) -> tuple[Worker, int]:
        """Start worker ``index``; it and the pipe its report comes on."""
        read, write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        with _signals_blocked():
            pid = os.fork()
            if pid == 0:  # the worker: never returns
                os.close(read)
                _work(self._worker_args(index), self.security, write, os.getppid())
            worker = self.workers[pid] = Worker(index, pid)
        os.close(write)
        return worker, read

    def _worker_args(self, index: int) -> argparse.Namespace:
        args = argparse.Namespace(**vars(self.args))
        if args.metrics_port:
            args.metrics_port += index - 1
        return args

    def _report(self, worker: Worker, fd: int) -> Bound | UsageError:
        """What ``worker`` reports on ``fd``: where it serves, or why it cannot (a worker
        that ended without saying is reaped)."""
        with os.fdopen(fd) as pipe:
            text = pipe.read()
        if text:
            said = json.loads(text)
            if "error" in said:
                return UsageError.of(ValueError(said["error"]))
            return Bound(**said)
        self.workers.pop(worker.pid, None)
        _, status = os.waitpid(worker.pid, 0)
        return UsageError("--workers", f"worker {worker.index} {_ended(status)} before serving")

    def _supervise(self) -> int:
        """Until every worker has ended: start again those that die unless stopping; the
        exit status."""
        clean = True
        while self.workers:
            pid, status = os.waitpid(-1, 0)
            worker = self.workers.pop(pid, None)
            if worker is None:
                continue
            if self.stopping:
                clean &= os.waitstatus_to_exitcode(status) in (0, -signal.SIGTERM)
                continue
            log.warning("worker %d (pid %d) %s; starting it again", worker.index, pid,
                        _ended(status))  # fmt: skip
            if not self._restart(worker.index):
                clean = False
                self.stopping = True
                self._signal_all(signal.SIGTERM)
        return 0 if clean else 1

    def _restart(self, index: int) -> bool:
        """Start worker ``index`` again, trying until it serves or the supervisor stops;
        False when there were too many restarts (the workers keep dying)."""
        while not self.stopping:
            now = time.monotonic()
            while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
                self._restarts.popleft()
            if len(self._restarts) >= MAX_RESTARTS:
                log.error(
                    "%d worker restarts within %g s: stopping every worker",
                    MAX_RESTARTS,
                    RESTART_WINDOW_S,
                )
                return False
            self._restarts.append(now)
            time.sleep(RESTART_DELAY_S)
            if self.stopping:
                break
            worker, fd = self._fork(index)
            report = self._report(worker, fd)
            if isinstance(report, Bound):
                log.warning("serving again: %s", _worker_line(worker, report))
                return True
            if self.workers.pop(worker.pid, None):
                os.waitpid(worker.pid, 0)
            if not self.stopping:
                log.warning("worker %d could not start again: %s", index, report)
        return True

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        self._signal_all(signal.SIGTERM)

    def _signal_all(self, sig: int) -> None:
        for worker in list(self.workers.values()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, sig)

    def _wait_all(self) -> None:
        while self.workers:
            pid, _ = os.waitpid(-1, 0)
            self.workers.pop(pid, None)


def _work(
    args: argparse.Namespace, security: ServerSecurity, report_fd: int, supervisor: int
) -> None:
    """A worker's life: serve, having reported on ``report_fd`` where (or why it cannot);
    exits the process, at once if its ``supervisor`` (pid) is gone."""
    reported = False

    def report(said: dict) -> None:
        nonlocal reported
        with os.fdopen(report_fd, "w") as pipe:
            pipe.write(json.dumps(said))
        reported = True

    code = 1
    try:
        for sig in _SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
        _die_with_parent()
        if os.getppid() != supervisor:  # it died before the line above
            return
        code = serve_process(args, security, lambda bound: report(asdict(bound)))
    except UsageError as exc:
        if not reported:
            report({"error": str(exc)})
        code = 2
    except BaseException:
        log.exception("worker failed")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _die_with_parent() -> None:
    """Have the kernel send this process SIGTERM when its parent dies (Linux only)."""
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """SIGTERM and SIGINT held back meanwhile: a worker just forked must not run the
    supervisor's handler before it has restored the default ones."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)


def _free_port(host: str, port: int, flag: str) -> int:
    """``port`` (0: a free one) once it is checked free on every address of ``host`` this
    machine has: nothing listens there, with ``SO_REUSEPORT`` or without."""
    shown = f"[{host}]" if ":" in host else host
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(flag, f"cannot listen on {shown}:{port}: {exc.strerror}") from None
    with contextlib.ExitStack() as probes:
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            try:
                probe = probes.enter_context(socket.socket(family, kind, proto))
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
                probe.bind((address[0], port, *address[2:]))
            except OSError as exc:
                if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                    continue  # an address (family) this machine lacks: gRPC skips it too
                raise UsageError(
                    flag, f"cannot listen on {shown}:{port}: {exc.strerror or exc}"
                ) from None
            port = port or probe.getsockname()[1]
    return port


def _worker_line(worker: Worker, bound: Bound) -> str:
    metrics = f": metrics on {bound.metrics_url}" if bound.metrics_url else ""
    return f"worker {worker.index} (pid {worker.pid}){metrics}"


def _ended(status: int) -> str:
    """How a process with wait status ``status`` ended."""
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"
