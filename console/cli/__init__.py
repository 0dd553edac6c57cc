"""The ``gridwatch`` command: one entry point, a subcommand per job.

Each area registers its own subcommands; heavy imports (textual, torch) happen
only inside the subcommand that needs them, so ``gridwatch --help`` is instant
and the agent runs on a node without torch.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

from agents.exitcodes import EXIT_ERROR

# Modules that each expose ``register(subparsers)``; order is the order in --help.
_COMMAND_MODULES = (
    "agents.cli",  # agent
    "console.cli.commands",  # tail, keys
    "console.cli.ui",  # console
    "console.cli.relay",  # relay
    "playbooks.cli",  # playbook
    "console.cli.train",  # train
    "console.cli.preflight",  # preflight
    "console.cli.demo",  # demo, fault
)



def _version() -> str:
    try:
        return version("gridwatch")
    except PackageNotFoundError:
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gridwatch",
        description="The on-call console for large GPU training runs.",
    )
    parser.add_argument("--version", action="version", version=f"gridwatch {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_ERROR
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
