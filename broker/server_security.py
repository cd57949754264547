"""What the broker's gRPC port demands (:class:`ServerSecurity`, the ``pdbroker serve``
flags): TLS credentials checked at start-up and the authorization guard of the servicer.
Certificates and keys are PEM files; who may do what once a caller is identified is
:mod:`broker.auth`; how clients connect is :mod:`broker.client_security`.

Server modes: TLS (``tls_cert`` + ``tls_key``); mutual TLS (also ``tls_client_ca``: every
client must present a certificate it signed, whose names identify the caller); bearer tokens
(``auth_tokens``, TLS only); or plaintext, which must be asked for (``insecure``). Callers
are authenticated, and authorized by :class:`~broker.auth.AccessGuard`, when client
certificates or tokens are on; TLS alone only encrypts.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc

from broker.auth import AccessGuard, Authenticator, TokenTable
from broker.client_security import read_file
from broker.store.contract import StateStore


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
        chain = read_file("--tls-cert", self.tls_cert)
        key = read_file("--tls-key", self.tls_key)
        client_ca = read_file("--tls-client-ca", self.tls_client_ca) if self.tls_client_ca else None
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
