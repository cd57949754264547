"""What a broker call costs Redis: the round trips of a
:class:`~broker.store.redis.RedisStateStore`'s client (each send of one or more commands,
counted by its connections), the values its replies carried (each string, number or nil,
however nested: what a read of N records or members grows with) and the commands the server
ran (``INFO commandstats``, those run by scripts included), for the tests that pin them and
the benchmarks that report them."""

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
    """Round trips of the client, values in its replies and commands of the server, by
    command name."""

    round_trips: int
    commands: dict[str, int]
    reply_values: int = 0

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
        self.reply_values = 0
        pool = store.client.connection_pool
        counter = self

        class Counted(pool.connection_class):  # type: ignore[name-defined]
            def send_packed_command(self, command: Any, check_health: bool = True) -> None:
                counter.round_trips += 1
                super().send_packed_command(command, check_health)

            def read_response(self, *args: Any, **kwargs: Any) -> Any:
                response = super().read_response(*args, **kwargs)
                counter.reply_values += _values(response)
                return response

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
        before, values = self.round_trips, self.reply_values
        result = call()
        trips, values = self.round_trips - before, self.reply_values - values
        return result, RedisCost(trips, self.server_commands(), values)


def _values(reply: Any) -> int:
    """Strings, numbers and nils in ``reply``, however nested."""
    if isinstance(reply, (list, tuple, set)):
        return sum(_values(value) for value in reply)
    if isinstance(reply, dict):
        return sum(_values(key) + _values(value) for key, value in reply.items())
    return 1
