"""Thin typer commands over the package; no logic of their own. One module per command group;
importing them registers each command on ``app`` in the order ``--help`` lists them."""

from streamquake.cli import running, between_runs, checking, game_day, describe, capacity  # noqa: F401, I001
from streamquake.cli.base import CAPACITY_EXIT_CODES_HELP, EXIT_CODES_HELP, app
from streamquake.cli.entry import KEPT_OUTPUT, main

__all__ = ["CAPACITY_EXIT_CODES_HELP", "EXIT_CODES_HELP", "KEPT_OUTPUT", "app", "main"]
