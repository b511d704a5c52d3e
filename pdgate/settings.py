"""One way to turn a pydantic-settings class into a CLI: a flag per field, its help naming the
environment variable (and an older name, where a service still reads one) and the default, so `--help`
documents every setting of every pdgate command the same way, and the rule `--some-flag` of
`pdgate-<command>` = `PDGATE_<COMMAND>_SOME_FLAG` (a flag wins) holds for all of them.

Why one module: the router, the metaserver, the simulator and the local launcher each had their own copy
of this loop (the launcher even its own reading of the environment), and the copies drifted (which
fields became `append` flags, how defaults were shown, how a boolean was read from the environment).
Here: the flags (`add_settings_flags`, `settings_parser`), the reading (`parse_settings`: flags given
on the command line over the environment over the defaults, all validated by the class; `reading_toml`
puts a config file between the environment and the defaults), and the words a command prints when its
settings do not validate (`invalid_settings`).

A field's metavar is its name in capitals unless the field says otherwise
(`Field(..., json_schema_extra={"metavar": "URL"})`). A `list[...]` field is a repeatable flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, cast, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, TomlConfigSettingsSource

__all__ = ["add_settings_flags", "given", "invalid_settings", "parse_settings", "reading_toml", "settings_parser"]

S = TypeVar("S", bound=BaseSettings)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _metavar(name: str, field: FieldInfo) -> str:
    extra = field.json_schema_extra
    if isinstance(extra, dict) and isinstance(extra.get("metavar"), str):
        return str(extra["metavar"])
    return name.upper()


def _flag_kwargs(name: str, field: FieldInfo, env: str) -> dict[str, Any]:
    """argparse keywords of one field: its kind of flag and its help (description, env names, default)."""
    help_text = f"{field.description} [env {env}]"
    kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
    annotation = field.annotation
    if annotation is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif get_origin(annotation) is list:
        kwargs["action"] = "append"
        kwargs["metavar"] = _metavar(name, field)
    elif get_origin(annotation) is Literal:
        kwargs["choices"] = list(get_args(annotation))
    else:
        kwargs["metavar"] = _metavar(name, field)
    default = field.get_default(call_default_factory=True)
    if default not in (None, []) and not isinstance(default, bool):
        help_text += f" (default: {getattr(default, 'value', default)})"
    kwargs["help"] = help_text
    return kwargs


def add_settings_flags(
    parser: argparse.ArgumentParser,
    cls: type[BaseSettings],
    *,
    env_prefix: str,
    legacy_prefix: str | None = None,
) -> argparse.ArgumentParser:
    """One flag per field of `cls` on `parser` (a command's parser or a subcommand's). A flag not given
    is absent from the parsed namespace, so the class reads the environment and its defaults for it.
    `legacy_prefix`: an older env prefix the class still reads (its help names both)."""
    for name, field in cls.model_fields.items():
        env = env_prefix + name.upper()
        if legacy_prefix is not None:
            env += f", or {legacy_prefix}{name.upper()}"
        parser.add_argument(_flag(name), **_flag_kwargs(name, field, env))
    return parser


def settings_parser(
    cls: type[BaseSettings],
    *,
    prog: str,
    description: str,
    env_prefix: str,
    legacy_prefix: str | None = None,
) -> argparse.ArgumentParser:
    """argparse flags derived from a settings class: one flag per field, help = description + env + default."""
    older = f" (or by its older name {legacy_prefix}<NAME>)" if legacy_prefix is not None else ""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=f"{description} Every flag can also be set as an environment variable {env_prefix}<NAME>"
        f"{older}; a flag wins.",
    )
    return add_settings_flags(parser, cls, env_prefix=env_prefix, legacy_prefix=legacy_prefix)


def parse_settings(cls: type[S], parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> S:
    """The settings: flags given on the command line override the environment, which overrides the
    defaults. Raises pydantic's ValidationError when they do not validate (`invalid_settings` words it)."""
    return cls(**vars(parser.parse_args(argv)))


def reading_toml(cls: type[S], path: Path) -> type[S]:
    """`cls` reading the TOML file at `path` too: below the flags given and the environment (an operator's
    export or flag overrides what a file says), above the defaults. Nothing else is read (no .env)."""

    def sources(
        settings_cls: type[BaseSettings], **chain: PydanticBaseSettingsSource
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return chain["init_settings"], chain["env_settings"], TomlConfigSettingsSource(settings_cls, toml_file=path)

    members = {"__module__": cls.__module__, "settings_customise_sources": staticmethod(sources)}
    return cast("type[S]", type(cls.__name__, (cls,), members))


def given(namespace: argparse.Namespace, *, leave_out: Sequence[str] = ()) -> dict[str, Any]:
    """The flags a namespace holds (those given on the command line), less `leave_out` (a subcommand's name)."""
    return {k: v for k, v in vars(namespace).items() if k not in leave_out}


def invalid_settings(exc: ValidationError) -> str:
    """One line naming every setting that did not validate and why (for a command's exit status 2)."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors())
