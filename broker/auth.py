"""Who is calling, and what they may do: identities from client certificates and bearer
tokens, and the broker's authorization rules.

**Identity.** A caller is known by names: with mutual TLS, its certificate's common name and
every subject alternative name (DNS, URI, ...); with a tokens file, the name its bearer token
(``authorization: Bearer TOKEN`` metadata) maps to. A caller that presents a token must
present a known one; a caller with no name at all (a certificate whose names are all empty
counts as none) is UNAUTHENTICATED.

**Rules** (PERMISSION_DENIED otherwise, the message naming the field):

* an engine acts only as itself: ``engine_id`` of RegisterRank, PublishBlocks,
  GetTransferPlan, ExtendTransfers, ReportTransfer and WatchReleases must be one of the
  caller's names or a data-parallel rank ``NAME_dp<N>`` vLLM derives from one
  (:func:`broker.wire.names_engine`), and KeepAlive/Deregister only renew or end leases of
  its own ranks (``lease_id``);
* a report must come from the decode engine holding the plan (``plan_id``); which decode
  engines may fetch a transfer's plans is the publication's ``allowed_decode_engines``
  (checked by :class:`~broker.service.BrokerService`);
* a transfer's *parties* are its prefill engine and the decode engines that may read it (the
  one that claimed it; before that those the publication allows, every decode engine when it
  names none): parties and operators may GetTransfer and AbortTransfer it — a decode engine
  that may read a transfer could as well claim it, so letting it abort adds no power;
* operators (the ``admins`` names) may also ListEngines and ListTransfers.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from broker.errors import (
    LimitExceededError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
)
from broker.records import TransferRecord
from broker.store.contract import StateStore
from broker.wire import names_engine

log = logging.getLogger(__name__)

#: Keys of a gRPC auth context holding the verified client certificate's names.
_CERTIFICATE_NAME_KEYS = ("x509_common_name", "x509_subject_alternative_name")
#: Shortest token a tokens file may hold (characters).
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class Identity:
    """The names a caller proved (certificate names, the token's name)."""

    names: frozenset[str]

    def acts_for(self, engine_id: str) -> bool:
        """Whether the caller may act as ``engine_id``: one of its names, or a data-parallel
        rank of one (``NAME_dp<N>``)."""
        return names_engine(self.names, engine_id)

    def __str__(self) -> str:
        return "/".join(sorted(self.names))


class TokenTable:
    """Bearer tokens and the identity each stands for, kept as SHA-256 digests only.

    The file has one ``NAME: TOKEN`` per line (``#`` starts a comment); a name may have several
    tokens (rotation), a token only one name, and tokens have at least
    :data:`MIN_TOKEN_CHARS` characters.
    """

    def __init__(self, names_by_token: dict[str, str]) -> None:
        self._names = {_digest(token): name for token, name in names_by_token.items()}

    @classmethod
    def load(cls, path: str | Path) -> TokenTable:
        """Read a tokens file; ``ValueError`` names the file and line of a bad entry."""
        names_by_token: dict[str, str] = {}
        for number, raw in enumerate(Path(path).read_text().splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            name, sep, token = (part.strip() for part in line.partition(":"))
            where = f"{path}:{number}"
            if not sep or not name or not token or len(token.split()) != 1:
                raise ValueError(f"{where}: expected 'NAME: TOKEN'")
            if len(token) < MIN_TOKEN_CHARS:
                raise ValueError(
                    f"{where}: the token of {name!r} is shorter than {MIN_TOKEN_CHARS} characters"
                )
            if names_by_token.setdefault(token, name) != name:
                raise ValueError(f"{where}: {name!r} reuses the token of {names_by_token[token]!r}")
        if not names_by_token:
            raise ValueError(f"{path}: no tokens")
        return cls(names_by_token)

    def name_of(self, token: str) -> str | None:
        return self._names.get(_digest(token))


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Authenticator:
    """Turns a call's verified client certificate and bearer token into an :class:`Identity`.

    ``certificates``: the server verifies client certificates (mutual TLS), so their names
    count. ``tokens``: bearer tokens are accepted (None: ignored).
    """

    def __init__(self, certificates: bool, tokens: TokenTable | None) -> None:
        self.certificates = certificates
        self.tokens = tokens

    def identify(self, context: Any) -> Identity:
        """The caller of the call whose ``grpc.aio.ServicerContext`` is ``context``; raises
        :class:`UnauthenticatedError` on a bad or missing credential."""
        names: set[str] = set()
        if self.certificates:
            names.update(_certificate_names(context.auth_context()))
        if self.tokens is not None:
            token = _bearer_token(context.invocation_metadata())
            if token:
                name = self.tokens.name_of(token)
                if name is None:
                    _unauthenticated(context, "unknown bearer token")
                names.add(name)
        if not names:
            _unauthenticated(
                context, "no bearer token" if self.tokens else "no client certificate name"
            )
        return Identity(frozenset(names))

    def refusal(self, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
        """Why a call with these metadata cannot be authenticated, or None when it may be:
        decided before its request is received, so an unauthenticated caller costs no more
        than its headers. A certificate's names are checked with the request."""
        if self.tokens is None:
            return None
        try:
            token = _bearer_token(metadata)
        except UnauthenticatedError as exc:
            return exc.detail
        if token:
            return None if self.tokens.name_of(token) is not None else "unknown bearer token"
        return None if self.certificates else "no bearer token"


def _certificate_names(auth: dict[str, Iterable[bytes]]) -> Iterator[str]:
    """The verified certificate's common name and subject alternative names; empty names and
    names that are not UTF-8 identify nobody and are left out."""
    for key in _CERTIFICATE_NAME_KEYS:
        for value in auth.get(key, ()):
            try:
                name = value.decode()
            except UnicodeDecodeError:
                continue
            if name.strip():
                yield name


def _unauthenticated(context: Any, message: str) -> NoReturn:
    log.warning("unauthenticated call from %s: %s", context.peer(), message)
    raise UnauthenticatedError("authorization", message)


def _bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The token of ``authorization: Bearer TOKEN`` ('' when the call carries none)."""
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = str(value).partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise UnauthenticatedError("authorization", "expected 'Bearer TOKEN'")
            return token.strip()
    return ""


class AccessGuard:
    """The rules of the module docstring over the broker's records (read only).

    Checks of objects the broker does not know (a lease, plan or transfer id) pass, so the
    service answers NOT_FOUND as it would without authorization.
    """

    def __init__(
        self,
        authenticator: Authenticator,
        store: StateStore,
        admins: frozenset[str] = frozenset(),
        max_ranks_per_identity: int = 1024,
    ) -> None:
        self.authenticator = authenticator
        self.store = store
        self.admins = admins
        self.max_ranks_per_identity = max_ranks_per_identity

    def identify(self, context: Any) -> Identity:
        return self.authenticator.identify(context)

    def act_as(self, who: Identity, engine_id: str, field: str = "engine_id") -> None:
        if not who.acts_for(engine_id):
            _deny(field, f"caller {who} may not act for engine {engine_id!r}")

    def register(self, who: Identity, engine_id: str, tp_rank: int) -> None:
        """As :meth:`act_as`, and within the caller's rank quota (a rank registering again
        takes no more)."""
        self.act_as(who, engine_id)
        held = self.store.ranks_named(who.names)
        if (engine_id, tp_rank) not in held and len(held) >= self.max_ranks_per_identity:
            log.warning("rank quota: caller %s holds %d ranks", who, len(held))
            raise LimitExceededError(
                "tp_rank",
                f"caller {who} already holds {len(held)} registered ranks, its quota "
                "(--max-ranks-per-identity)",
            )

    def hold_lease(self, who: Identity, lease_id: str) -> None:
        record = self.store.rank_by_lease(lease_id)
        if record is not None:
            self.act_as(who, record.registration.engine_id, "lease_id")

    def report_plan(self, who: Identity, plan_id: str) -> None:
        key = self.store.transfer_of_plan(plan_id)
        transfer = None if key is None else self.store.get_transfer(key)
        if transfer is None or transfer.plan_by_id(plan_id) is None:
            return  # an unknown plan: the service says so
        if not who.acts_for(transfer.decode_engine_id):
            _deny("plan_id", f"plan {plan_id} is not a plan of caller {who}")

    def see_transfer(self, who: Identity, transfer_id: str, prefill_engine_id: str = "") -> str:
        """Parties of the transfer and operators only (GetTransfer, AbortTransfer): the
        transfer of ``prefill_engine_id`` or, unnamed, the one published under
        ``transfer_id`` the caller is a party of. Returns its publisher ('' when that is
        for the service to decide: an operator's call, an unknown id, or several the caller
        may see). Others' transfers are NOT_FOUND, as unknown ids are."""
        if who.names & self.admins:
            return prefill_engine_id
        keys = (
            [(prefill_engine_id, transfer_id)]
            if prefill_engine_id
            else self.store.transfers_named(transfer_id)
        )
        found = [t for key in keys if (t := self.store.get_transfer(key)) is not None]
        theirs = [t for t in found if self._party(who, t)]
        if found and not theirs:
            log.warning("transfer %r hidden from caller %s: not a party", transfer_id, who)
            raise NotFoundError("transfer_id", f"no transfer {transfer_id!r}")
        return theirs[0].prefill_engine_id if len(theirs) == 1 else prefill_engine_id

    def _party(self, who: Identity, transfer: TransferRecord) -> bool:
        """Whether the caller published ``transfer``, claimed it, or may read it."""
        if who.acts_for(transfer.prefill_engine_id):
            return True
        if transfer.decode_engine_id:
            claimer = transfer.decode_engine_id
            return who.acts_for(claimer) and self._reads(claimer)
        engines = {key[0] for key in self.store.ranks_named(who.names)}
        return any(transfer.admits(e) and self._reads(e) for e in engines)

    def administer(self, who: Identity) -> None:
        """Operators only (ListEngines, ListTransfers)."""
        if not who.names & self.admins:
            _deny("authorization", f"caller {who} is not an operator")

    def _reads(self, engine_id: str) -> bool:
        """Whether ``engine_id`` is a registered engine that reads (decode or both)."""
        ranks = self.store.engine_ranks(engine_id)
        return bool(ranks) and ranks[0].registration.role.reads


def _deny(field: str, message: str) -> NoReturn:
    log.warning("permission denied: %s: %s", field, message)
    raise PermissionDeniedError(field, message)
