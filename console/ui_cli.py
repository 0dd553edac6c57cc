"""Subcommands of this area (placeholder until the area lands)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:  # noqa: ARG001 - filled in by the area
    return None
