"""How a :class:`~semblend_sglang.config.Config` field is declared, named in each source and parsed.

A setting is declared once, as a field of the ``Config`` dataclass whose default is
:func:`setting` (default, help, bounds, choices, JSON aliases in the field's metadata).
:func:`specs_of` derives one :class:`FieldSpec` per such field, in declaration order; the
environment variable (``SEMBLEND_<NAME>``) and the flag (``--semblend-<name>``) follow from the
name. :func:`parse_value` turns a value from any source into the field's type or raises
:class:`ConfigError`; :class:`SourceFields` reads the settings each source (environment, JSON
object, CLI flags) sets; :func:`markdown_table` renders the specs as the settings table of
docs/provider.md. Nothing here knows a particular setting.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

ENV_PREFIX = "SEMBLEND_"
FLAG_PREFIX = "--semblend-"
_METADATA_KEY = "semblend_setting"
_MIB = 1024 * 1024

logger = logging.getLogger(__name__)
_warned: set[str] = set()
_warned_lock = threading.Lock()


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
    tuning: bool = False
    """A knob of the mechanism, listed apart from what a user sets (:data:`SETTINGS_GROUPS`)."""

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


SETTINGS_GROUPS = (
    (False, "Settings a user sets"),
    (True, "Tuning: knobs of the mechanism; change one with the measurement that needs it"),
)
"""The settings table's groups, in order: (``FieldSpec.tuning``, heading)."""


def markdown_table(specs: Iterable[FieldSpec]) -> str:
    """The settings table of docs/provider.md: per group of :data:`SETTINGS_GROUPS`, a bold
    heading line, then one row per spec of that group (field, env var, CLI flag, JSON keys,
    default, allowed values, help); groups separated by a blank line, ending in a newline."""
    specs = list(specs)
    parts = []
    for tuning, heading in SETTINGS_GROUPS:
        group = [spec for spec in specs if spec.tuning == tuning]
        if group:
            parts.append(f"**{heading}**\n\n" + _rows(group))
    return "\n".join(parts)


def _rows(specs: Iterable[FieldSpec]) -> str:
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


Resolve = Callable[[dict[str, Any], dict[str, str]], dict[str, Any]]
"""Folds a source's shorthands into settings: ``resolve(layer, keys)`` gets the values one
source sets by setting name and that source's key of each name (for errors); raises
:class:`ConfigError` on a conflict."""


@dataclass(frozen=True)
class SourceFields:
    """Every setting a source may set (``specs``, in order), looked up by each source's key,
    with ``resolve`` for the shorthands among them and ``other_env``, the SEMBLEND_* variables
    of other parts of the project (neither settings nor unknown). Used by ``Config.from_sources``;
    reads its sources, never changes them."""

    specs: tuple[FieldSpec, ...]
    resolve: Resolve
    other_env: frozenset[str] = frozenset()
    by_name: dict[str, FieldSpec] = field(init=False)
    by_env: dict[str, FieldSpec] = field(init=False)
    by_flag: dict[str, FieldSpec] = field(init=False)
    by_json: dict[str, FieldSpec] = field(init=False)

    def __post_init__(self) -> None:
        json_keys = {s.name: s for s in self.specs}
        json_keys.update({alias: s for s in self.specs for alias in s.json_aliases})
        object.__setattr__(self, "by_name", {s.name: s for s in self.specs})
        object.__setattr__(self, "by_env", {s.env: s for s in self.specs})
        object.__setattr__(self, "by_flag", {s.flag: s for s in self.specs})
        object.__setattr__(self, "by_json", json_keys)

    def merge(
        self,
        env: Mapping[str, str] | None,
        json_obj: Mapping[str, Any] | None,
        cli: Mapping[str, Any] | None,
    ) -> tuple[dict[str, Any], list[str]]:
        """The parsed values ``env`` < ``json_obj`` < ``cli`` set, by setting name (a later
        source wins), and the unknown env variables and JSON keys (each logged once). A source
        that is None is not read. Raises ConfigError naming the key of a bad value."""
        merged: dict[str, Any] = {}
        unknown: list[str] = []
        if env is not None:
            merged.update(self._env_layer(env, unknown))
        if json_obj is not None:
            merged.update(self._json_layer(json_obj, unknown))
        if cli is not None:
            merged.update(self._cli_layer(cli))
        return merged, unknown

    def _env_layer(self, environ: Mapping[str, str], unknown: list[str]) -> dict[str, Any]:
        layer: dict[str, Any] = {}
        for key in sorted(environ):
            if not key.startswith(ENV_PREFIX) or key in self.other_env:
                continue
            spec = self.by_env.get(key)
            if spec is None:
                unknown.append(key)
                _warn_once(f"unknown environment variable {key} ignored (not a SemBlend setting)")
                continue
            layer[spec.name] = parse_value(spec, environ[key], key)
        return self.resolve(layer, {s.name: s.env for s in self.specs})

    def _json_layer(self, obj: Mapping[str, Any], unknown: list[str]) -> dict[str, Any]:
        if not isinstance(obj, Mapping):
            raise ConfigError("kv_connector_extra_config", obj, "a JSON object")
        layer: dict[str, Any] = {}
        names: dict[str, str] = {}
        for key in sorted(obj):
            spec = self.by_json.get(key)
            if spec is None:
                unknown.append(key)
                _warn_once(f"unknown SemBlend JSON key {key!r} ignored")
                continue
            if spec.name in layer:
                raise ConfigError(key, obj[key], f"only one of {names[spec.name]!r} and {key!r}")
            layer[spec.name] = parse_value(spec, obj[key], key)
            names[spec.name] = key
        return self.resolve(layer, {s.name: names.get(s.name, s.name) for s in self.specs})

    def _cli_layer(self, cli: Mapping[str, Any]) -> dict[str, Any]:
        layer: dict[str, Any] = {}
        for key in sorted(cli):
            value = cli[key]
            if value is None:  # click passes None for flags that were not given
                continue
            spec = self.by_flag.get(key) or self.by_name.get(key.replace("-", "_"))
            if spec is None and key.startswith("semblend_"):
                spec = self.by_name.get(key[len("semblend_") :])
            if spec is None:
                raise ConfigError(key, value, "a --semblend-* flag listed in config.FIELDS")
            layer[spec.name] = parse_value(spec, value, spec.flag)
        return self.resolve(layer, {s.name: s.flag for s in self.specs})


def _warn_once(message: str) -> None:
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    logger.warning(message)
