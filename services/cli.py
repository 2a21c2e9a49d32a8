"""Command-line flags with environment-variable fallbacks, for the services' `main`s only.

Every flag `--some-flag` can also come from PAGEDSERVE_SOME_FLAG; a flag on the command
line wins. Nothing below a `main` reads the environment (STYLE.md).
"""
from __future__ import annotations

import argparse
import os

ENV_PREFIX = "PAGEDSERVE_"


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def add_flag(parser: argparse.ArgumentParser, flag: str, default=None, type=str, help: str = "") -> None:
    """A value flag whose default comes from the environment when set there."""
    raw = os.environ.get(env_name(flag))
    value = type(raw) if raw is not None else default
    parser.add_argument(flag, default=value, type=type, help=f"{help} [env {env_name(flag)}]")


def add_switch(parser: argparse.ArgumentParser, flag: str, default: bool, help: str = "") -> None:
    """--flag / --no-flag, default from the environment (1/true/yes) when set there."""
    raw = os.environ.get(env_name(flag))
    value = raw.lower() in ("1", "true", "yes", "on") if raw is not None else default
    parser.add_argument(flag, default=value, action=argparse.BooleanOptionalAction,
                        help=f"{help} [env {env_name(flag)}]")
