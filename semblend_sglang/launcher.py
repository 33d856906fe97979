"""What ``semblend-sglang serve`` resolves before it starts SGLang: the Config and the child env.

The launcher's own flags are the ``--semblend-*`` flags of :data:`config.FIELDS` plus
``--semblend-config`` (a JSON object, or ``@path`` to a file holding one, in the shape of vLLM's
``kv_connector_extra_config``). Sources merge as in :meth:`Config.from_sources`: defaults <
``SEMBLEND_*`` environment < ``--semblend-config`` < ``--semblend-*`` flags. The resolved Config
is exported to the server's processes as a complete set of ``SEMBLEND_*`` variables (SGLang's
scheduler reads it there through the plugin), so every child sees exactly the launcher's view.

Nothing here imports sglang except :func:`sglang_flags_help`.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .config import FIELDS, FIELDS_BY_FLAG, Config, ConfigError

CONFIG_FLAG = "--semblend-config"
"""The launcher flag that takes a JSON object (or ``@path``) as one configuration source."""

SEMBLEND_FLAG_PREFIX = "--semblend-"


def semblend_flags() -> tuple[str, ...]:
    """Every ``--semblend-*`` flag the launcher accepts, in help order."""
    return (*(spec.flag for spec in FIELDS), CONFIG_FLAG)


def read_config_json(value: str) -> dict[str, Any]:
    """Parse ``--semblend-config``: a JSON object, or ``@path`` naming a file with one.

    Raises ConfigError naming the flag for unreadable files, invalid JSON and non-objects.
    """
    text = value
    if value.startswith("@"):
        path = Path(value[1:]).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                CONFIG_FLAG, value, f"a readable JSON file ({exc.strerror})"
            ) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(CONFIG_FLAG, value, f"a JSON object ({exc.msg} at {exc.pos})") from None
    if not isinstance(obj, dict):
        raise ConfigError(CONFIG_FLAG, value, "a JSON object")
    return obj


def unknown_semblend_flags(args: Sequence[str]) -> list[str]:
    """``--semblend-*`` words in ``args`` naming no launcher flag (they must not reach sglang)."""
    known = set(semblend_flags())
    out = []
    for arg in args:
        name = arg.split("=", 1)[0]
        if name.startswith(SEMBLEND_FLAG_PREFIX) and name not in known:
            out.append(name)
    return out


def unknown_flag_message(flag: str) -> str:
    """One-line error for an unknown ``--semblend-*`` flag, with the closest known flag."""
    close = difflib.get_close_matches(flag, semblend_flags(), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"no such option: {flag}{hint}; see `semblend-sglang serve --help`"


def resolve_config(
    environ: Mapping[str, str],
    flag_values: Mapping[str, str | None],
    config_json: str | None = None,
) -> Config:
    """The launcher's Config from the environment, ``--semblend-config`` and flag values.

    ``flag_values`` maps ``--semblend-*`` flags (or their click names) to the strings given, None
    for flags not given. An unset SEMBLEND_ENABLED means enabled (the launcher exists to enable
    SemBlend); ``--semblend-enabled 0`` or SEMBLEND_ENABLED=0 serve vanilla SGLang. Raises
    ConfigError naming the offending flag, variable or JSON key.
    """
    json_obj = read_config_json(config_json) if config_json is not None else None
    return Config.from_sources(env=environ, json_obj=json_obj, cli=dict(flag_values))


def config_environ(config: Config) -> dict[str, str]:
    """Every Config field as a SEMBLEND_* variable, in the form :func:`config.parse_value` reads.

    ``discovery_only`` is not written: it is folded into ``SEMBLEND_MODE``.
    """
    out: dict[str, str] = {}
    for spec in FIELDS:
        if spec.name == "discovery_only":
            continue
        value = getattr(config, spec.name)
        if spec.type is bool:
            out[spec.env] = "1" if value else "0"
        elif spec.type is float:
            out[spec.env] = repr(float(value))
        else:
            out[spec.env] = str(value)
    return out


def flag_for_param(param_name: str) -> str | None:
    """The ``--semblend-*`` flag of a click parameter name (``semblend_min_similarity``)."""
    flag = "--" + param_name.replace("_", "-")
    return flag if flag in FIELDS_BY_FLAG or flag == CONFIG_FLAG else None


def sglang_flags_help() -> str:
    """The option list of ``python -m sglang.launch_server --help`` (imports sglang: seconds).

    Applies the CPU runtime's torchvision shim first, so it works on a machine without CUDA.
    """
    import argparse

    from .cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog="python -m sglang.launch_server", usage=argparse.SUPPRESS, add_help=False
    )
    ServerArgs.add_cli_args(parser)
    return parser.format_help()
