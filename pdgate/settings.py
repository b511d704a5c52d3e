"""One way to turn a pydantic-settings class into a CLI: a flag per field, its help naming the
environment variable and the default, so `--help` documents every setting of every service the same way.

Why one module: the router, the metaserver, the simulator and the local launcher each had their own copy
of this loop, and the copies drifted (which fields became `append` flags, how defaults were shown).
"""

from __future__ import annotations

import argparse
from typing import Any, Literal, get_args, get_origin

from pydantic_settings import BaseSettings

__all__ = ["settings_parser"]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def settings_parser(
    cls: type[BaseSettings], *, prog: str, description: str, env_prefix: str
) -> argparse.ArgumentParser:
    """argparse flags derived from a settings class: one flag per field, help = description + env + default."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=f"{description} Every flag can also be set as an environment variable {env_prefix}<NAME>; "
        "a flag wins.",
    )
    for name, field in cls.model_fields.items():
        help_text = f"{field.description} [env {env_prefix}{name.upper()}]"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
        annotation = field.annotation
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_origin(annotation) is list:
            kwargs["action"] = "append"
            kwargs["metavar"] = "URL" if name in ("prefill", "decode") else "KEY"
        elif get_origin(annotation) is Literal:
            kwargs["choices"] = list(get_args(annotation))
        else:
            kwargs["metavar"] = name.upper()
        default = field.get_default(call_default_factory=True)
        if default not in (None, []) and not isinstance(default, bool):
            help_text += f" (default: {getattr(default, 'value', default)})"
        kwargs["help"] = help_text
        parser.add_argument(_flag(name), **kwargs)
    return parser
