"""One request's reuse settings: what ``custom_params.semblend_reuse`` asks for, over the server's.

The value a request may send (``sampling_params.custom_params`` of ``/generate``; ``extra_body=
{"custom_params": ...}`` of the OpenAI-compatible API)::

    true, "on", or no key        the server's settings
    false, "off"                 no semantic reuse (the request still donates)
    {"preset": "fast"}           the preset's settings (presets.PRESETS), the rest defaults
    {"recompute_ratio": 0.3}     the server's settings with this repair setting replaced
    {"preset": "fast", "recompute_ratio": 0.3}   the preset, then the setting

An object may hold ``preset`` and any of :data:`~semblend_sglang.presets.REPAIR_SETTINGS`, each
checked like the setting itself (its bounds and choices); anything else is an error naming the
key. :func:`resolve` is pure and deterministic: every tensor-parallel and data-parallel rank
that receives the same request resolves the same settings. The request guard calls it at the
tokenizer manager (a bad value is a 400); the scheduler calls it again (an in-process engine has
no guard: a bad value there serves the request without reuse).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .config import FIELDS_BY_NAME, Config, ConfigError, parse_value
from .presets import PRESETS, REPAIR_SETTINGS

REUSE_PARAM = "semblend_reuse"
"""The ``custom_params`` key a request sets its reuse with (module docstring)."""

PRESET_KEY = "preset"

SERVER_LABEL = "server"
""":attr:`RequestSettings.label` of a request served with the server's settings."""
CUSTOM_LABEL = "custom"
""":attr:`RequestSettings.label` of a request that set repair settings of its own."""

_ON = (True, "on")
_OFF = (False, "off")
_CACHE_LIMIT = 256


@dataclass(frozen=True, slots=True)
class RequestSettings:
    """The settings one request is served with: ``config``, the server's Config with the
    request's repair settings in place, and ``label``, how the snapshot counts it
    (:data:`SERVER_LABEL`, a preset's name, or :data:`CUSTOM_LABEL`)."""

    config: Config
    label: str = SERVER_LABEL


def _is(value: Any, choices: tuple[Any, ...]) -> bool:
    return any(value is c or (isinstance(c, str) and value == c) for c in choices)


def _key(name: str) -> str:
    return f"custom_params.{REUSE_PARAM}.{name}"


def _overrides(value: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The preset and the parsed repair settings of a request's object; ConfigError names the
    first bad key."""
    preset = value.get(PRESET_KEY)
    if PRESET_KEY in value and preset not in PRESETS:
        raise ConfigError(_key(PRESET_KEY), preset, "one of " + ", ".join(PRESETS))
    out: dict[str, Any] = {}
    for name in sorted(value):
        if name == PRESET_KEY:
            continue
        if not isinstance(name, str) or name not in REPAIR_SETTINGS:
            allowed = ", ".join((PRESET_KEY, *REPAIR_SETTINGS))
            where = "a server setting" if name in FIELDS_BY_NAME else "not a setting"
            raise ConfigError(_key(str(name)), value[name], f"{where}; a request sets {allowed}")
        out[name] = parse_value(FIELDS_BY_NAME[name], value[name], _key(name))
    return preset, out


_resolved: dict[tuple[int, str], tuple[Config, RequestSettings]] = {}


def resolve(value: Any, server: Config) -> RequestSettings | None:
    """The settings a request with :data:`REUSE_PARAM` ``value`` is served with on a server
    configured ``server``; None when it opted out. Raises ConfigError naming the key (under
    ``custom_params.semblend_reuse``) for any value the module docstring does not list."""
    if _is(value, _ON):
        return RequestSettings(server)
    if _is(value, _OFF):
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"custom_params.{REUSE_PARAM}",
            value,
            'true, false, "on", "off", or an object of "preset" and repair settings',
        )
    try:
        memo = (id(server), json.dumps(value, sort_keys=True))
    except (TypeError, ValueError):
        memo = None
    found = None if memo is None else _resolved.get(memo)
    if found is not None and found[0] is server:
        return found[1]
    preset, overrides = _overrides(value)
    config = server
    if preset is not None:
        base = {name: FIELDS_BY_NAME[name].default for name in REPAIR_SETTINGS}
        config = replace(server, **{**base, **PRESETS[preset]}, preset=preset)
    if overrides:
        config = replace(config, **overrides)
    label = CUSTOM_LABEL if overrides else (preset or SERVER_LABEL)
    settings = RequestSettings(config, label)
    if memo is not None:
        if len(_resolved) >= _CACHE_LIMIT:
            _resolved.clear()
        _resolved[memo] = (server, settings)
    return settings


def value_error(custom_params: Any) -> str | None:
    """Why ``custom_params`` carries a :data:`REUSE_PARAM` that :func:`resolve` refuses, or
    None (key absent, or a value it takes). The request guard answers it with 400."""
    if not isinstance(custom_params, Mapping) or REUSE_PARAM not in custom_params:
        return None
    try:
        resolve(custom_params[REUSE_PARAM], Config())
    except ConfigError as exc:
        return str(exc)[:400]
    return None
