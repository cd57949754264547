"""Transport security of the broker's gRPC port: what the server demands
(:class:`ServerSecurity`, the ``pdbroker serve`` flags) and how clients connect
(:class:`ChannelSecurity`). Certificates and keys are PEM files; who may do what once a caller
is identified is :mod:`broker.auth`.

Server modes: TLS (``tls_cert`` + ``tls_key``); mutual TLS (also ``tls_client_ca``: every
client must present a certificate it signed, whose names identify the caller); bearer tokens
(``auth_tokens``, TLS only); or plaintext, which must be asked for (``insecure``). Callers
are authenticated, and authorized by :class:`~broker.auth.AccessGuard`, when client
certificates or tokens are on; TLS alone only encrypts.
"""

from __future__ import annotations

import ipaddress
import logging
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from broker.auth import AccessGuard, Authenticator, TokenTable
from broker.store.contract import StateStore

log = logging.getLogger(__name__)

#: Channel options: ``(name, value)`` pairs as gRPC takes them.
Options = Sequence[tuple[str, int | str]]


@dataclass(frozen=True)
class ServerSecurity:
    """What the broker's port demands; each field is the ``pdbroker serve`` flag of that name.

    ``ValueError`` (naming the flag) for contradictory or incomplete settings: plaintext must
    be asked for with ``insecure``, which excludes every TLS setting; tokens need TLS;
    ``admin_identities`` need a way to identify callers.
    """

    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    auth_tokens: str = ""
    admin_identities: frozenset[str] = frozenset()
    insecure: bool = False
    #: Ranks one identity may hold registered, over every engine it names.
    max_ranks_per_identity: int = 1024

    def __post_init__(self) -> None:
        tls = {
            "--tls-cert": self.tls_cert,
            "--tls-key": self.tls_key,
            "--tls-client-ca": self.tls_client_ca,
            "--auth-tokens": self.auth_tokens,
        }
        if self.insecure:
            given = [flag for flag, value in tls.items() if value]
            if given:
                raise ValueError(f"--insecure: cannot be combined with {', '.join(given)}")
        elif not self.tls_cert:
            raise ValueError(
                "--tls-cert: required (with --tls-key) unless --insecure asks for a plaintext port"
            )
        elif not self.tls_key:
            raise ValueError("--tls-key: required with --tls-cert")
        if self.admin_identities and not self.authenticates:
            raise ValueError(
                "--admin-identities: callers are only identified with "
                "--tls-client-ca or --auth-tokens"
            )

    @property
    def authenticates(self) -> bool:
        """Whether callers are identified (client certificates or tokens) and authorized."""
        return bool(self.tls_client_ca or self.auth_tokens)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials from the files (None when insecure); ``ValueError`` names the flag
        of a file that cannot be read, holds no PEM certificate (key), or of a key that is not
        the certificate's: gRPC itself would only fail when the port opens."""
        if self.insecure:
            return None
        chain = _read("--tls-cert", self.tls_cert)
        key = _read("--tls-key", self.tls_key)
        client_ca = _read("--tls-client-ca", self.tls_client_ca) if self.tls_client_ca else None
        _check_certificates("--tls-cert", self.tls_cert, chain)
        if client_ca is not None:
            _check_certificates("--tls-client-ca", self.tls_client_ca, client_ca)
        _check_key_pair(self.tls_cert, self.tls_key)
        return grpc.ssl_server_credentials(
            [(key, chain)],
            root_certificates=client_ca,
            require_client_auth=bool(self.tls_client_ca),
        )

    def guard(self, store: StateStore) -> AccessGuard | None:
        """The authorization of calls over ``store``'s records; None when callers are not
        identified."""
        if not self.authenticates:
            return None
        tokens = None
        if self.auth_tokens:
            try:
                tokens = TokenTable.load(self.auth_tokens)
            except (OSError, ValueError) as exc:
                raise ValueError(f"--auth-tokens: {exc}") from None
        return AccessGuard(
            Authenticator(bool(self.tls_client_ca), tokens),
            store,
            self.admin_identities,
            self.max_ranks_per_identity,
        )

    def describe(self) -> str:
        """One line for the log: the mode and how callers are identified."""
        if self.insecure:
            return "plaintext, no authentication"
        how = " and ".join(
            name
            for name, file in (
                ("client certificates", self.tls_client_ca),
                ("bearer tokens", self.auth_tokens),
            )
            if file
        )
        if not how:
            return "TLS without client authentication: any caller may act as any engine"
        return f"TLS, callers identified by {how}"


@dataclass(frozen=True)
class ChannelSecurity:
    """How a client connects to the broker; the fields are the ``pdbroker status`` flags and
    the vLLM connector's settings of the same names.

    TLS when ``tls_ca`` is set: the broker's certificate must chain to it and name the
    target's host. ``tls_cert`` + ``tls_key`` add this client's certificate (mutual TLS);
    ``token`` is sent on every call as ``authorization: Bearer TOKEN``. The default is
    plaintext, which logs a warning unless the target is a loopback address.
    """

    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not self.tls_ca and (self.tls_cert or self.tls_key or self.token):
            raise ValueError(
                "tls_ca: a client certificate or token needs TLS, which needs the CA that "
                "signed the broker's certificate"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert: a client certificate needs both tls_cert and tls_key")

    @classmethod
    def from_files(
        cls, tls_ca: str = "", tls_cert: str = "", tls_key: str = "", token_file: str = ""
    ) -> ChannelSecurity:
        """Like the constructor, with the token read from ``token_file`` (its only line)."""
        token = _read("token_file", token_file).decode().strip() if token_file else ""
        return cls(tls_ca, tls_cert, tls_key, token)

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca)

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS (and token) credentials from the files; None for plaintext."""
        if not self.tls:
            return None
        credentials = grpc.ssl_channel_credentials(
            _read("tls_ca", self.tls_ca),
            _read("tls_key", self.tls_key) if self.tls_key else None,
            _read("tls_cert", self.tls_cert) if self.tls_cert else None,
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
                "unauthenticated (set tls_ca to use TLS)",
                target,
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


def _read(field_name: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{field_name}: cannot read {path}: {exc.strerror}") from None


def _tls_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.set_ciphers("DEFAULT:@SECLEVEL=0")  # gRPC's checks decide what is too weak
    return context


def _check_certificates(flag: str, path: str, pem: bytes) -> None:
    """``ValueError`` naming ``flag`` unless ``pem`` holds PEM certificates that parse."""
    try:
        _tls_context().load_verify_locations(cadata=pem.decode("ascii"))
    except (UnicodeDecodeError, ValueError, ssl.SSLError):
        raise ValueError(f"{flag}: {path} holds no PEM certificate") from None


def _check_key_pair(cert_path: str, key_path: str) -> None:
    """``ValueError`` naming ``--tls-key`` unless it is an unencrypted PEM private key whose
    public key is that of the first certificate of ``cert_path`` (the TLS library's own
    check, with nothing beyond the standard library)."""
    try:
        _tls_context().load_cert_chain(cert_path, key_path, password=_no_password)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(
                f"--tls-key: {key_path} is not the private key of the certificate in {cert_path}"
            ) from None
        raise ValueError(f"--tls-key: {key_path} holds no unencrypted PEM private key") from None
    except OSError as exc:
        raise ValueError(f"--tls-key: cannot read {key_path}: {exc.strerror}") from None


def _no_password() -> bytes:
    return b""  # an encrypted key then fails to decrypt instead of prompting
