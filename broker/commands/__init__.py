"""Subcommands of the ``pdbroker`` CLI (see :data:`broker.cli.COMMAND_MODULES`)."""
