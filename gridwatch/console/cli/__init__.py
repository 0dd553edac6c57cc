"""The ``gridwatch`` command: one entry point, a subcommand per job.

Each area registers its own subcommands; heavy imports (textual, torch) happen
only inside the subcommand that needs them, so ``gridwatch --help`` is instant
and the agent runs on a node without torch.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module
from typing import Any

from gridwatch.wire.exitcodes import EXIT_ERROR

# Modules that each expose ``register(subparsers)``; order is the order in --help.
_COMMAND_MODULES = (
    "gridwatch.agent.cli",  # agent
    "gridwatch.console.cli.commands",  # tail, keys
    "gridwatch.console.cli.ui",  # console
    "gridwatch.relay.cli",  # relay
    "gridwatch.playbooks.cli",  # playbook
    "gridwatch.console.cli.train",  # train
    "gridwatch.console.cli.preflight",  # preflight
    "gridwatch.console.cli.logs",  # logs: from the console's log store
    "gridwatch.console.cli.scene",  # scene: an incident's scenes from the console's scene store
    "gridwatch.console.cli.demo",  # demo, fault
)



def _version() -> str:
    # Imported here: importlib.metadata (email, zipfile, csv ...) is 1.5 MB of every agent's memory otherwise.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gridwatch")
    except PackageNotFoundError:
        return "0+unknown"


class _VersionAction(argparse.Action):
    """``--version``: the installed version, read only when asked for."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, default: Any = argparse.SUPPRESS,
                 help: str = "show the version and exit") -> None:  # noqa: A002 - argparse's own keyword
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"gridwatch {_version()}")
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """No abbreviated flags: ``demo --headles`` must be an error, not a full demo. Every subcommand's parser
    is of this class too (argparse makes them of their parent's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gridwatch",
        description="The on-call console for large GPU training runs.",
    )
    parser.add_argument("--version", action=_VersionAction)
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
