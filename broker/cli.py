"""``pdbroker`` command line: each subcommand lives in a module of :mod:`broker.commands`;
every parser shares :class:`Parser` (one-line usage errors) and :class:`HelpFormatter`."""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, NoReturn

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
DESCRIPTION = (
    "A gRPC transfer broker for disaggregated prefill/decode serving of hybrid "
    "(Mamba/SSM + attention) models, and the tools around it."
)
EPILOG = """\
exit status:
  0  success
  1  a runtime failure: a check failed, a broker answered with an error or cannot be reached
  2  a usage or configuration error: a bad flag, environment variable or input file, a port
     already in use; one line on stderr, 'pdbroker COMMAND: error: --flag: why'

'pdbroker COMMAND --help' describes each command."""
#: Docstring markup: ``literal``, :role:`target` (``~`` keeps the last name of a dotted one).
_MARKUP = re.compile(r"``([^`]+)``|:[a-z]+:`(~?)([^`]+)`")


def plain(text: str) -> str:
    """``text`` (a docstring) with its markup as plain text."""

    def render(match: re.Match[str]) -> str:
        literal, tilde, target = match.groups()
        if literal is not None:
            return literal
        return target.rsplit(".", 1)[-1] if tilde else target

    return _MARKUP.sub(render, text)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions (docstrings) as plain text, each paragraph filled to the terminal's width
    unless indented; every option's default shown unless it is unset (None or empty), a
    switch's (False) or already in its help."""

    def _format_text(self, text: str) -> str:
        width = max(self._width - self._current_indent, 11)
        paragraphs = [
            part
            if re.search(r"^\s", part, re.MULTILINE)
            else textwrap.fill(" ".join(part.split()), width, break_on_hyphens=False)
            for part in plain(text).strip("\n").split("\n\n")
        ]
        return super()._format_text("\n\n".join(paragraphs) + "\n")

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if text is None or "%(default)" in text or not action.option_strings:
            return text
        if (
            action.default is None
            or action.default is False
            or action.default in ("", argparse.SUPPRESS)
        ):
            return text
        return f"{text} (default: %(default)s)"

    def _expand_help(self, action: argparse.Action) -> str:
        return plain(super()._expand_help(action))


class Parser(argparse.ArgumentParser):
    """Every parser and subparser of ``pdbroker``: the shared help format, and a usage error
    as one line ``PROG: error: --flag: why`` with exit status 2 (``--help`` has the usage)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message.removeprefix('argument ')}\n")


class _Version(argparse.Action):
    """``--version``: the installed distribution's version, else the package's own."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        print(f"pdbroker {version()}")
        parser.exit()


def version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("pdbroker")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        from broker import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pdbroker", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
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
