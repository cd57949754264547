"""What a broker call costs Redis: the round trips of a
:class:`~broker.store.redis.RedisStateStore`'s client (each send of one or more commands,
counted by its connections) and the commands the server ran (``INFO commandstats``, those
run by scripts included), for the tests that pin them and the benchmarks that report them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from broker.store.redis import RedisStateStore

T = TypeVar("T")

#: Commands of the counting itself, left out of the server's counts.
_OWN_COMMANDS = frozenset({"info", "config|resetstat"})


@dataclass(frozen=True)
class RedisCost:
    """Round trips of the client and commands of the server, by command name."""

    round_trips: int
    commands: dict[str, int]

    @property
    def total_commands(self) -> int:
        return sum(self.commands.values())


class RedisCounter:
    """Counts the round trips of ``store``'s client from now on (call it before the store
    opened a connection: connections made before are not counted) and reads the commands
    its server ran."""

    def __init__(self, store: RedisStateStore) -> None:
        self.store = store
        self.round_trips = 0
        pool = store.client.connection_pool
        counter = self

        class Counted(pool.connection_class):  # type: ignore[name-defined]
            def send_packed_command(self, command: Any, check_health: bool = True) -> None:
                counter.round_trips += 1
                super().send_packed_command(command, check_health)

        pool.connection_class = Counted

    def server_commands(self) -> dict[str, int]:
        """Commands run by the server since its statistics were reset, by name."""
        stats = self.store.client.info("commandstats")
        calls = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
        return {name: n for name, n in calls.items() if name not in _OWN_COMMANDS}

    def measure(self, call: Callable[[], T]) -> tuple[T, RedisCost]:
        """``call()``'s result and what it cost Redis (nothing else may use the server
        meanwhile)."""
        self.store.client.config_resetstat()
        before = self.round_trips
        result = call()
        trips = self.round_trips - before
        return result, RedisCost(trips, self.server_commands())
