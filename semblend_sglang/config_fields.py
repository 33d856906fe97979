"""How a :class:`~semblend_sglang.config.Config` field is declared, named in each source and parsed.

A setting is declared once, as a field of the ``Config`` dataclass whose default is
:func:`setting` (default, help, bounds, choices, JSON aliases in the field's metadata).
:func:`specs_of` derives one :class:`FieldSpec` per such field, in declaration order; the
environment variable (``SEMBLEND_<NAME>``) and the flag (``--semblend-<name>``) follow from the
name. :func:`parse_value` turns a value from any source into the field's type or raises
:class:`ConfigError`; :func:`markdown_table` renders the specs as the settings table of
docs/provider.md. Nothing here knows a particular setting.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

ENV_PREFIX = "SEMBLEND_"
FLAG_PREFIX = "--semblend-"
_METADATA_KEY = "semblend_setting"
_MIB = 1024 * 1024


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key, the value and what is
    allowed; ``key``, ``value`` and ``allowed`` carry the same as attributes."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        super().__init__(f"invalid value for {key}: {value!r} (allowed: {allowed})")
        self.key = key
        self.value = value
        self.allowed = allowed


@dataclass(frozen=True, slots=True)
class _Declared:
    """What :func:`setting` stores in a dataclass field's metadata."""

    help: str
    choices: tuple[str, ...] | None
    minimum: float | None
    maximum: float | None
    json_aliases: tuple[str, ...]


def setting(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    json_aliases: tuple[str, ...] = (),
) -> Any:
    """A dataclass field that is a setting: ``default``, one-sentence ``help``, and what is
    allowed (``choices`` for strings; inclusive ``minimum``/``maximum`` for numbers).
    ``json_aliases``: further JSON keys that set it. The field's annotation is its type (bool,
    int, float, str, or a ``StrEnum`` whose values are the choices)."""
    declared = _Declared(help, choices, minimum, maximum, tuple(json_aliases))
    return field(default=default, metadata={_METADATA_KEY: declared})


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """How one Config field is named in each source, its type, default, bounds and help."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    json_aliases: tuple[str, ...] = ()

    @property
    def env(self) -> str:
        """Environment variable name, e.g. ``SEMBLEND_MIN_SIMILARITY``."""
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        """CLI flag name, e.g. ``--semblend-min-similarity``."""
        return FLAG_PREFIX + self.name.replace("_", "-")

    def allowed(self) -> str:
        """Human-readable description of the accepted values."""
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        if self.type is bool:
            return "a boolean: 1/0, true/false, yes/no, on/off"
        if self.type is str:
            return "a string"
        kind = "an integer" if self.type is int else "a number"
        lo = "-inf" if self.minimum is None else _number(self.minimum)
        hi = "inf" if self.maximum is None else _number(self.maximum)
        return f"{kind} in [{lo}, {hi}]"


def _number(x: float, *, mib: bool = False) -> str:
    """``x`` without a spurious exponent or ``.0``; with ``mib``, a whole number of MiB (1 MiB or
    more) as ``N MiB``."""
    if float(x).is_integer():
        n = int(x)
        return f"{n // _MIB} MiB" if mib and n >= _MIB and n % _MIB == 0 else str(n)
    return f"{x:g}"


def specs_of(cls: type) -> Iterator[FieldSpec]:
    """One FieldSpec per field of dataclass ``cls`` declared with :func:`setting`, in
    declaration order (other fields are skipped)."""
    hints = get_type_hints(cls)
    for f in fields(cls):
        declared = f.metadata.get(_METADATA_KEY)
        if declared is None:
            continue
        kind = hints[f.name]
        choices = declared.choices
        if is_choice_enum(kind):
            choices = tuple(member.value for member in kind)
        yield FieldSpec(
            f.name,
            kind,
            f.default,
            declared.help,
            choices,
            declared.minimum,
            declared.maximum,
            declared.json_aliases,
        )


def is_choice_enum(kind: Any) -> bool:
    """True when a setting's type ``kind`` is a ``StrEnum``: its values are the choices and
    :func:`parse_value` returns the member."""
    return isinstance(kind, type) and issubclass(kind, enum.StrEnum)


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_flag(value: str | None) -> bool | None:
    """A boolean written as 1/0, true/false, yes/no or on/off (any case, spaces ignored); None
    for anything else, empty or missing. The one reading of a boolean setting or environment
    variable: callers choose what None means (a ConfigError, or a default)."""
    if value is None:
        return None
    word = value.strip().lower()
    if word in _TRUE:
        return True
    return False if word in _FALSE else None


def parse_value(spec: FieldSpec, value: Any, key: str) -> Any:
    """Convert ``value`` (a string from env/CLI or a JSON value) to ``spec``'s type and check it.

    ``key`` is the name reported in a ConfigError (env var, JSON key or flag).
    """
    allowed = spec.allowed()
    if spec.type is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        flag = parse_flag(value) if isinstance(value, str) else None
        if flag is None:
            raise ConfigError(key, value, allowed)
        return flag
    if spec.type is str or is_choice_enum(spec.type):
        if not isinstance(value, str):
            raise ConfigError(key, value, allowed)
        out_s = value.strip()
        if spec.choices is not None:
            out_s = out_s.lower()
            if out_s not in spec.choices:
                raise ConfigError(key, value, allowed)
        return spec.type(out_s) if is_choice_enum(spec.type) else out_s
    out = _parse_number(spec, value, key, allowed)
    if (spec.minimum is not None and out < spec.minimum) or (
        spec.maximum is not None and out > spec.maximum
    ):
        raise ConfigError(key, value, allowed)
    return out


def _parse_number(spec: FieldSpec, value: Any, key: str, allowed: str) -> int | float:
    """``value`` as an int (``spec.type is int``: integral floats too) or a finite float."""
    if isinstance(value, bool):
        raise ConfigError(key, value, allowed)
    if spec.type is int:
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                raise ConfigError(key, value, allowed) from None
        raise ConfigError(key, value, allowed)
    if isinstance(value, int | float):
        out = float(value)
    elif isinstance(value, str):
        try:
            out = float(value.strip())
        except ValueError:
            raise ConfigError(key, value, allowed) from None
    else:
        raise ConfigError(key, value, allowed)
    if not math.isfinite(out):
        raise ConfigError(key, value, allowed)
    return out


def format_default(spec: FieldSpec) -> str:
    """The default as the settings table shows it (``parse_value`` reads it back; a whole
    number of MiB, 1 MiB or more, is written ``N MiB``)."""
    value = spec.default
    if spec.type is bool:
        return "1" if value else "0"
    if spec.type is str or is_choice_enum(spec.type):
        return str(value) or '""'
    return repr(value) if spec.type is float else _number(value, mib=True)


def _short_allowed(spec: FieldSpec) -> str:
    if spec.choices is not None:
        return ", ".join(spec.choices)
    if spec.type is bool:
        return "bool"
    if spec.type is str:
        return "string"
    lo = None if spec.minimum is None else _number(spec.minimum, mib=True)
    hi = None if spec.maximum is None else _number(spec.maximum)
    if lo is not None and hi is not None:
        return f"[{lo}, {hi}]"
    if lo is not None:
        return f">= {lo}"
    return "any" if hi is None else f"<= {hi}"


def markdown_table(specs: Iterable[FieldSpec]) -> str:
    """The settings table of docs/provider.md: one row per spec (field, env var, CLI flag, JSON
    keys, default, allowed values, help), ending in a newline."""
    rows = [
        "| field | env var | CLI flag | JSON key | default | allowed | meaning |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec in specs:
        keys = ", ".join((spec.name, *spec.json_aliases))
        rows.append(
            f"| {spec.name} | {spec.env} | {spec.flag} | {keys} | {format_default(spec)} "
            f"| {_short_allowed(spec)} | {spec.help} |"
        )
    return "\n".join(rows) + "\n"
