"""Command lines generated from the config dataclasses, for the `main`s only.

Each field of a config dataclass (a `setting`, services/core/config.py) is a flag
`--field-name` (or the setting's `flag`) with the field's default and help text; a bool field
is a switch (--flag / --no-flag); a field that is itself a dataclass (FrontendConfig.grammar,
SchedulerServiceConfig.scheduler) brings that dataclass's flags. vLLM's EngineArgs.add_cli_args
does the same. Every flag can also come from PAGEDSERVE_FIELD_NAME (PAGEDSERVE_<ALIAS> for
an old name); the command line wins. Nothing below a `main` reads the environment (CONTRIBUTING.md, house style).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.core.errors import InvalidArgument

ENV_PREFIX = "PAGEDSERVE_"
TRUE = ("1", "true", "yes", "on")
METAVARS = {"int": "N", "float": "NUM", "str": "TEXT", "Path": "PATH", "SpeculativeConfig": "JSON"}


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


@dataclass(frozen=True, kw_only=True)
class Flag:
    """One field's flag."""

    name: str  # --block-size
    dest: str  # the argparse attribute, block_size
    owner: type  # the dataclass that holds the field
    field: str  # the field's name (not the dest where the setting names another flag)
    type: type  # bool (a switch), int, float, str or Path
    default: Any  # dataclasses.MISSING: a default_factory's, computed per process
    help: str
    aliases: tuple[str, ...] = ()

    @property
    def is_switch(self) -> bool:
        return self.type is bool

    @property
    def metavar(self) -> str:
        return METAVARS.get(self.type.__name__, "VALUE")

    @property
    def parse(self):
        """Text -> value. A setting whose type is a dataclass (speculative_config, given as JSON) stays
        text: the dataclass that holds it parses it when built, so a refusal names its flag."""
        return str if dataclasses.is_dataclass(self.type) else self.type

    def default_value(self) -> Any:
        if self.default is not dataclasses.MISSING:
            return self.default
        field = next(f for f in dataclasses.fields(self.owner) if f.name == self.field)
        return field.default_factory()


def _value_type(hint) -> type:
    """int for `int | None`, and so on."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def _is_config(hint) -> bool:
    return dataclasses.is_dataclass(hint) and isinstance(hint, type)


def flags_of(*classes: type) -> list[Flag]:
    """The flags of these dataclasses' fields (nested dataclasses' too), in field order."""
    flags = []
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if _is_config(hints[f.name]):
                flags += flags_of(hints[f.name])
            elif f.metadata.get("cli", False):
                name = f.metadata["flag"] or "--" + f.name.replace("_", "-")
                flags.append(Flag(name=name, dest=name[2:].replace("-", "_"), owner=cls, field=f.name,
                                  type=_value_type(hints[f.name]), default=f.default, help=f.metadata["help"],
                                  aliases=tuple(f.metadata["aliases"])))
    return flags


def describe(flag: Flag) -> str:
    """The help text a flag shows: the setting's, its default and its environment variable(s)."""
    default = "" if flag.default is dataclasses.MISSING else \
        f" (default: {'on' if flag.default else 'off'})" if flag.is_switch else \
        f" (default: {flag.default})" if flag.default not in (None, "") else ""
    envs = ", ".join(env_name(name) for name in (flag.name, *flag.aliases))
    return f"{flag.help}{default} [env {envs}]"


class _OldName(argparse.BooleanOptionalAction):
    """A switch that warns when given by an old name (an alias)."""

    def __init__(self, *args, old_names: tuple[str, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.old_names = {n for name in old_names for n in (name, "--no-" + name[2:])}

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.old_names:
            print(f"{parser.prog}: warning: {option_string} is an old name of {self.option_strings[0]}",
                  file=sys.stderr)
        super().__call__(parser, namespace, values, option_string)


def _from_env(flag: Flag, env: Mapping[str, str]) -> Any:
    for name in (flag.name, *flag.aliases):
        raw = env.get(env_name(name))
        if raw is not None:
            return raw.lower() in TRUE if flag.is_switch else flag.parse(raw)
    return flag.default_value()


def add_config_flags(parser: argparse.ArgumentParser, *classes: type, env: Mapping[str, str] = os.environ,
                     only: tuple[str, ...] | None = None) -> None:
    """A flag for every setting of these dataclasses (`only`: for those fields alone, e.g. a tool that takes
    a few engine settings: `diverge`), its default taken from the environment when set there."""
    for flag in flags_of(*classes):
        if only is not None and flag.field not in only:
            continue
        default = _from_env(flag, env)
        if flag.is_switch:
            parser.add_argument(flag.name, *flag.aliases, dest=flag.dest, default=default, action=_OldName,
                                old_names=flag.aliases, help=describe(flag))
        else:
            parser.add_argument(flag.name, *flag.aliases, dest=flag.dest, default=default, type=flag.parse,
                                help=describe(flag), metavar=flag.metavar)


def _build(cls: type, args: argparse.Namespace) -> Any:
    hints, kwargs = typing.get_type_hints(cls), {}
    by_field = {flag.field: flag for flag in flags_of(cls) if flag.owner is cls}
    for f in dataclasses.fields(cls):
        if _is_config(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], args)
        elif f.name in by_field:
            kwargs[f.name] = getattr(args, by_field[f.name].dest)
    return cls(**kwargs)


def build_configs(args: argparse.Namespace, *classes: type, prog: str) -> tuple:
    """One instance of each dataclass from the parsed flags. A setting the dataclass refuses exits
    with status 2 (restarting cannot help) and a message naming its flag."""
    try:
        return tuple(_build(cls, args) for cls in classes)
    except InvalidArgument as error:
        names = [f.name for f in flags_of(*classes) if error.field in (f.field, f.dest)]
        print(f"{prog}: error: {names[0] if names else error.field}: {error.message}", file=sys.stderr)
        raise SystemExit(2) from None


def add_flag(parser: argparse.ArgumentParser, flag: str, default=None, type=str, help: str = "") -> None:
    """A value flag that is no config field (the launcher's own), its default from the environment when set."""
    raw = os.environ.get(env_name(flag))
    value = type(raw) if raw is not None else default
    parser.add_argument(flag, default=value, type=type, help=f"{help} [env {env_name(flag)}]")


