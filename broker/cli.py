"""``pdbroker`` command line: each subcommand lives in a module of :mod:`broker.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from broker.errors import PdbrokerError

#: Modules that each define ``register(subparsers)``; a command's handler is ``args.run``.
COMMAND_MODULES = (
    "broker.commands.plan",
    "broker.commands.bench",
    "broker.commands.layout",
    "broker.commands.serve",
    "broker.commands.demo",
    "broker.commands.status",
    "broker.commands.soak",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdbroker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except PdbrokerError as exc:
        print(f"pdbroker {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
