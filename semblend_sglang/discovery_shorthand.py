"""The ``discovery_only`` shorthand: how one settings source may say ``mode=discovery_only``.

``discovery_only`` (SEMBLEND_DISCOVERY_ONLY, JSON ``discovery_only``, ``--semblend-discovery-only``)
is a shorthand for ``mode=discovery_only`` inside the source that sets it: true selects that mode;
true together with another mode in the same source is a ConfigError; false together with
``mode=discovery_only`` in the same source is a ConfigError; false alone changes nothing.

Used only by :mod:`.config` (the field list and the merge of each source).
"""

from __future__ import annotations

from typing import Any

from .config_fields import ConfigError, FieldSpec


def resolve_discovery_only(layer: dict[str, Any], keys: dict[str, str]) -> dict[str, Any]:
    """Fold ``discovery_only`` into ``mode`` inside one source (module docstring)."""
    if "discovery_only" not in layer:
        return layer
    out = dict(layer)
    flag = out.pop("discovery_only")
    mode = out.get("mode")
    if flag:
        if mode is not None and mode != "discovery_only":
            raise ConfigError(
                keys["discovery_only"],
                True,
                f"false when {keys['mode']}={mode!r} is set in the same source",
            )
        out["mode"] = "discovery_only"
    elif mode == "discovery_only":
        raise ConfigError(
            keys["discovery_only"],
            False,
            f"true (or unset) when {keys['mode']}='discovery_only' is set in the same source",
        )
    return out


DISCOVERY_ONLY = FieldSpec(
    "discovery_only",
    bool,
    False,
    "Shorthand for mode=discovery_only (conflicting with another mode is an error).",
)
"""Not a Config field: a source-level shorthand folded into ``mode`` (module docstring)."""


def with_discovery_only(specs: list[FieldSpec]) -> tuple[FieldSpec, ...]:
    """``specs`` with :data:`DISCOVERY_ONLY` after ``mode``."""
    at = next(i for i, spec in enumerate(specs) if spec.name == "mode") + 1
    return (*specs[:at], DISCOVERY_ONLY, *specs[at:])
