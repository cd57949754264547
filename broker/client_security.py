"""How clients connect to the broker's gRPC port: :class:`ChannelSecurity` (TLS, a client
certificate, a bearer token, or plaintext). Shared by the engine clients and the operator
commands; imports nothing of the server (what the port demands is
:mod:`broker.server_security`). Certificates and keys are PEM files.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

#: Channel options: ``(name, value)`` pairs as gRPC takes them.
Options = Sequence[tuple[str, int | str]]


@dataclass(frozen=True)
class ChannelSecurity:
    """How a client connects to the broker; the fields are the ``pdbroker status`` flags and
    the vLLM connector's settings of the same names.

    TLS when ``tls_ca`` is set: the broker's certificate must chain to it and name the
    target's host. ``tls_cert`` + ``tls_key`` add this client's certificate (mutual TLS);
    ``token`` is sent on every call as ``authorization: Bearer TOKEN``. The default is
    plaintext, which logs a warning unless the target is a loopback address. Errors and
    warnings name the settings (``tls_ca``), or with ``flags`` the command-line flags
    (``--tls-ca``).
    """

    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    token: str = field(default="", repr=False)
    flags: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if not self.tls_ca and (self.tls_cert or self.tls_key or self.token):
            raise ValueError(
                f"{self.name('tls_ca')}: a client certificate or token needs TLS, which needs "
                "the CA that signed the broker's certificate"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            cert, key = self.name("tls_cert"), self.name("tls_key")
            raise ValueError(f"{cert}: a client certificate needs both {cert} and {key}")

    @classmethod
    def from_files(
        cls,
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        token_file: str = "",
        flags: bool = False,
    ) -> ChannelSecurity:
        """Like the constructor, with the token read from ``token_file`` (its only line)."""
        where = "--token-file" if flags else "token_file"
        token = read_file(where, token_file).decode().strip() if token_file else ""
        return cls(tls_ca, tls_cert, tls_key, token, flags)

    def name(self, setting: str) -> str:
        """How errors and warnings name ``setting``: itself, or its flag."""
        return "--" + setting.replace("_", "-") if self.flags else setting

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca)

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS (and token) credentials from the files; None for plaintext."""
        if not self.tls:
            return None
        credentials = grpc.ssl_channel_credentials(
            read_file(self.name("tls_ca"), self.tls_ca),
            read_file(self.name("tls_key"), self.tls_key) if self.tls_key else None,
            read_file(self.name("tls_cert"), self.tls_cert) if self.tls_cert else None,
        )
        if self.token:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.access_token_call_credentials(self.token)
            )
        return credentials

    def channel(self, target: str, options: Options = ()) -> grpc.Channel:
        """A blocking channel to ``target``."""
        credentials = self._credentials_for(target)
        if credentials is None:
            return grpc.insecure_channel(target, options=options)
        return grpc.secure_channel(target, credentials, options=options)

    def aio_channel(self, target: str, options: Options = ()) -> grpc.aio.Channel:
        """An asyncio channel to ``target``."""
        credentials = self._credentials_for(target)
        if credentials is None:
            return grpc.aio.insecure_channel(target, options=options)
        return grpc.aio.secure_channel(target, credentials, options=options)

    def _credentials_for(self, target: str) -> grpc.ChannelCredentials | None:
        credentials = self.credentials()
        if credentials is None and not is_loopback(target):
            log.warning(
                "connecting to the broker at %s without TLS: traffic is readable and "
                "unauthenticated (set %s to use TLS)",
                target,
                self.name("tls_ca"),
            )
        return credentials


#: The default of clients: plaintext, as before TLS existed (a warning unless on loopback).
PLAINTEXT = ChannelSecurity()


def is_loopback(target: str) -> bool:
    """Whether a gRPC target (``HOST:PORT``, ``dns:///HOST:PORT``, ``ipv4:``/``ipv6:``,
    ``unix:``) stays on this machine."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        target = target.removeprefix(scheme)
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or "]:" in target else target
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def speaks_tls(target: str, timeout_s: float = 2.0) -> bool | None:
    """Whether the port at ``target`` (``HOST:PORT``) answers a TLS handshake: True, False
    (it answers, not in TLS) or None (no answer: closed, unreachable). Certificates are not
    checked: it only tells a plaintext port from a TLS one."""
    host, _, port = target.rpartition(":")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        address = (host.strip("[]"), int(port))
        with socket.create_connection(address, timeout_s) as raw, context.wrap_socket(raw):
            return True
    except ssl.SSLError as exc:
        if isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
            return None
        return exc.reason != "WRONG_VERSION_NUMBER"  # any other: a TLS peer's alert
    except (OSError, ValueError):
        return None


def read_file(field_name: str, path: str) -> bytes:
    """The bytes of ``path``; ``ValueError`` naming ``field_name`` if it cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{field_name}: cannot read {path}: {exc.strerror}") from None
