"""One validated :class:`Config` from SEMBLEND_* environment variables, a JSON object and CLI flags.

Precedence (lowest to highest): built-in defaults < environment < JSON object
(vLLM ``kv_connector_extra_config``) < CLI flags. Each source is validated on its own; a bad value
raises :class:`ConfigError` naming the key, the value and what is allowed. Unknown SEMBLEND_*
variables and unknown JSON keys are logged once and listed in ``Config.unknown_keys``.
:data:`FIELDS` describes every field (env var, ``--semblend-*`` flag, type, default, help) for the
launcher that builds its click options from it.

``discovery_only`` (SEMBLEND_DISCOVERY_ONLY, JSON ``discovery_only``, ``--semblend-discovery-only``)
is a shorthand for ``mode=discovery_only`` inside the source that sets it: true selects that mode;
true together with another mode in the same source is a ConfigError; false together with
``mode=discovery_only`` in the same source is a ConfigError; false alone changes nothing.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

logger = logging.getLogger(__name__)

MODES = ("discovery_only", "exact_spans", "substitute")
EMBEDDERS = ("minilm", "jaccard", "none")

ENV_PREFIX = "SEMBLEND_"
OTHER_SEMBLEND_ENV = frozenset({"SEMBLEND_MODEL_CACHE"})
"""SEMBLEND_* variables owned by other parts of the project (not Config fields, not unknown)."""


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key, the value and what is
    allowed; ``key``, ``value`` and ``allowed`` carry the same as attributes."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        super().__init__(f"invalid value for {key}: {value!r} (allowed: {allowed})")
        self.key = key
        self.value = value
        self.allowed = allowed


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
        return "--semblend-" + self.name.replace("_", "-")

    def allowed(self) -> str:
        """Human-readable description of the accepted values."""
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        if self.type is bool:
            return "a boolean: 1/0, true/false, yes/no, on/off"
        kind = "an integer" if self.type is int else "a number"
        if self.type is str:
            return "a string"
        lo = "-inf" if self.minimum is None else f"{self.minimum:g}"
        hi = "inf" if self.maximum is None else f"{self.maximum:g}"
        return f"{kind} in [{lo}, {hi}]"


FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("enabled", bool, True, "Enable semantic donor lookup."),
    FieldSpec(
        "mode",
        str,
        "exact_spans",
        "discovery_only: lookup + telemetry only; exact_spans: reuse token-identical spans; "
        "substitute: SemBlend-style, may change the prompt (needs "
        "exact_materialization_only=0).",
        choices=MODES,
    ),
    FieldSpec(
        "discovery_only",
        bool,
        False,
        "Shorthand for mode=discovery_only (conflicting with another mode is an error).",
    ),
    FieldSpec("model_id", str, "", "Model identity recorded in the namespace (informational)."),
    FieldSpec(
        "min_similarity",
        float,
        0.60,
        "Minimum embedding cosine similarity (substitute mode gate, discovery telemetry).",
        minimum=0.0,
        maximum=1.0,
    ),
    FieldSpec(
        "embedder",
        str,
        "minilm",
        "Similarity for the substitute gate: minilm (sentence-transformers all-MiniLM-L6-v2), "
        "jaccard (token-chunk sketch), none.",
        choices=EMBEDDERS,
        json_aliases=("embedder_type",),
    ),
    FieldSpec(
        "strict_prefix_boundary",
        bool,
        False,
        "Plan one span from one donor (SemBlend-compatible) instead of up to max_spans spans.",
    ),
    FieldSpec(
        "max_plan_donors",
        int,
        8,
        "Donors whose spans one plan may combine (1: one donor per plan).",
        minimum=1,
        maximum=64,
    ),
    FieldSpec(
        "keep_reused_donors",
        bool,
        True,
        "Keep the unpublished prompt KV of a request that reused KV as donor KV outside SGLang's "
        "tree (evicted before the tree) instead of freeing it (SGLang 0.5.21+).",
    ),
    FieldSpec(
        "report_reuse_to_client",
        bool,
        False,
        "Add semantically reused tokens to the client-visible cached_tokens (off: clients see "
        "SGLang's exact prefix hit only; docs/security.md).",
    ),
    FieldSpec(
        "exact_materialization_only",
        bool,
        True,
        "Materialize only token-identical spans (must be 0 for mode=substitute).",
    ),
    FieldSpec(
        "min_prompt_tokens",
        int,
        256,
        "Prompts shorter than this are declined (prompt_too_short).",
        minimum=0,
    ),
    FieldSpec(
        "exact_sufficient_ratio",
        float,
        0.90,
        "Exact route when the exact prefix hit covers at least this fraction of the prompt.",
        minimum=0.0,
        maximum=1.0,
    ),
    FieldSpec(
        "min_reuse_tokens",
        int,
        128,
        "Minimum reused tokens of a plan (after trimming).",
        minimum=1,
    ),
    FieldSpec(
        "min_reuse_ratio",
        float,
        0.25,
        "Minimum reused tokens / tokens not covered by the exact hit.",
        minimum=0.0,
        maximum=1.0,
    ),
    FieldSpec(
        "sink_tokens",
        int,
        4,
        "Tokens recomputed at the start of each reused span (attention-sink effect).",
        minimum=0,
    ),
    FieldSpec("max_spans", int, 8, "Maximum spans in one plan.", minimum=1, maximum=4096),
    FieldSpec(
        "min_span_tokens",
        int,
        32,
        "Minimum length of an aligned identical span.",
        minimum=2,
        maximum=65536,
    ),
    FieldSpec(
        "max_donors",
        int,
        20000,
        "Donors kept in the index (least recently used evicted first).",
        minimum=1,
    ),
    FieldSpec(
        "max_index_bytes",
        int,
        512 * 1024 * 1024,
        "Bytes the donor index may hold (postings, records, token copies); the least recently "
        "used donors are dropped beyond it.",
        minimum=1024 * 1024,
    ),
    FieldSpec(
        "max_candidates",
        int,
        8,
        "Donor candidates aligned per lookup, best first.",
        minimum=1,
        maximum=64,
    ),
    FieldSpec(
        "lookup_budget_ms",
        float,
        5.0,
        "Work budget of one lookup in milliseconds of the reference CPU, counted in operations "
        "so that every rank decides alike; a lookup that runs out with no plan declines "
        "(lookup_budget).",
        minimum=0.01,
        maximum=10000.0,
    ),
    FieldSpec(
        "min_candidate_tokens",
        int,
        32,
        "Minimum shared-chunk tokens for a donor to be aligned at all.",
        minimum=1,
    ),
    FieldSpec(
        "chunk_avg_tokens",
        int,
        16,
        "Average content-defined chunk length (power of two).",
        minimum=8,
        maximum=4096,
    ),
    FieldSpec(
        "embed_discovery",
        bool,
        False,
        "In discovery_only mode, also embed query and donor and record their similarity.",
    ),
    FieldSpec(
        "dispatch_enabled",
        bool,
        True,
        "With --dp-size N: send each request to the data-parallel rank holding its donor "
        "(docs/scale-out.md).",
    ),
    FieldSpec(
        "dispatch_load_margin",
        int,
        8192,
        "Tokens a donor's rank may be loaded above the least-loaded rank and still be chosen; "
        "beyond it SGLang's own dispatch method decides.",
        minimum=0,
    ),
    FieldSpec(
        "dispatch_index_bytes",
        int,
        64 * 1024 * 1024,
        "Byte bound of the dispatcher's index of what went to which rank.",
        minimum=1024 * 1024,
    ),
    FieldSpec(
        "dispatch_chunk_avg_tokens",
        int,
        64,
        "Average content-defined chunk length (power of two) of the dispatcher's index; "
        "coarser than the provider's: a rank needs evidence, not alignment.",
        minimum=8,
        maximum=4096,
    ),
    FieldSpec(
        "dispatch_expire_ratio",
        float,
        1.0,
        "A dispatch entry expires once its rank was sent this many times its KV pool size in "
        "tokens since.",
        minimum=0.01,
        maximum=1000.0,
    ),
)

FIELDS_BY_NAME: dict[str, FieldSpec] = {f.name: f for f in FIELDS}
FIELDS_BY_ENV: dict[str, FieldSpec] = {f.env: f for f in FIELDS}
FIELDS_BY_FLAG: dict[str, FieldSpec] = {f.flag: f for f in FIELDS}


def _default(name: str) -> Any:
    """The default of field ``name``, declared once in :data:`FIELDS`."""
    return FIELDS_BY_NAME[name].default


_JSON_KEYS: dict[str, FieldSpec] = {
    **{f.name: f for f in FIELDS},
    **{alias: f for f in FIELDS for alias in f.json_aliases},
}

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(message: str) -> None:
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    logger.warning(message)


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
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(key, value, allowed)
    if spec.type is int:
        if isinstance(value, bool):
            raise ConfigError(key, value, allowed)
        if isinstance(value, int):
            out = value
        elif isinstance(value, float) and value.is_integer():
            out = int(value)
        elif isinstance(value, str):
            try:
                out = int(value.strip())
            except ValueError:
                raise ConfigError(key, value, allowed) from None
        else:
            raise ConfigError(key, value, allowed)
    elif spec.type is float:
        if isinstance(value, bool):
            raise ConfigError(key, value, allowed)
        if isinstance(value, (int, float)):
            out_f = float(value)
        elif isinstance(value, str):
            try:
                out_f = float(value.strip())
            except ValueError:
                raise ConfigError(key, value, allowed) from None
        else:
            raise ConfigError(key, value, allowed)
        if not math.isfinite(out_f):
            raise ConfigError(key, value, allowed)
        out = out_f
    else:
        if not isinstance(value, str):
            raise ConfigError(key, value, allowed)
        out = value.strip()
        if spec.choices is not None:
            out = out.lower()
            if out not in spec.choices:
                raise ConfigError(key, value, allowed)
        return out
    if (spec.minimum is not None and out < spec.minimum) or (
        spec.maximum is not None and out > spec.maximum
    ):
        raise ConfigError(key, value, allowed)
    return out


def _resolve_layer(layer: dict[str, Any], keys: dict[str, str]) -> dict[str, Any]:
    """Fold ``discovery_only`` into ``mode`` inside one source (see module docstring)."""
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


@dataclass(frozen=True, slots=True)
class Config:
    """Validated SemBlend settings; build with :meth:`from_env`, :meth:`from_json`,
    :meth:`from_sources` (never raise from the engine: build it at start-up)."""

    enabled: bool = _default("enabled")
    mode: str = _default("mode")
    model_id: str = _default("model_id")
    min_similarity: float = _default("min_similarity")
    embedder: str = _default("embedder")
    strict_prefix_boundary: bool = _default("strict_prefix_boundary")
    max_plan_donors: int = _default("max_plan_donors")
    keep_reused_donors: bool = _default("keep_reused_donors")
    report_reuse_to_client: bool = _default("report_reuse_to_client")
    exact_materialization_only: bool = _default("exact_materialization_only")
    min_prompt_tokens: int = _default("min_prompt_tokens")
    exact_sufficient_ratio: float = _default("exact_sufficient_ratio")
    min_reuse_tokens: int = _default("min_reuse_tokens")
    min_reuse_ratio: float = _default("min_reuse_ratio")
    sink_tokens: int = _default("sink_tokens")
    max_spans: int = _default("max_spans")
    min_span_tokens: int = _default("min_span_tokens")
    max_donors: int = _default("max_donors")
    max_index_bytes: int = _default("max_index_bytes")
    max_candidates: int = _default("max_candidates")
    min_candidate_tokens: int = _default("min_candidate_tokens")
    lookup_budget_ms: float = _default("lookup_budget_ms")
    chunk_avg_tokens: int = _default("chunk_avg_tokens")
    embed_discovery: bool = _default("embed_discovery")
    dispatch_enabled: bool = _default("dispatch_enabled")
    dispatch_load_margin: int = _default("dispatch_load_margin")
    dispatch_index_bytes: int = _default("dispatch_index_bytes")
    dispatch_chunk_avg_tokens: int = _default("dispatch_chunk_avg_tokens")
    dispatch_expire_ratio: float = _default("dispatch_expire_ratio")
    unknown_keys: tuple[str, ...] = field(default=(), compare=False)
    """SEMBLEND_* env vars and JSON keys that name no field (reported, not applied)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            spec = FIELDS_BY_NAME.get(f.name)
            if spec is not None:
                parse_value(spec, getattr(self, f.name), f.name)
        if self.chunk_avg_tokens & (self.chunk_avg_tokens - 1):
            raise ConfigError("chunk_avg_tokens", self.chunk_avg_tokens, "a power of two >= 8")
        if self.dispatch_chunk_avg_tokens & (self.dispatch_chunk_avg_tokens - 1):
            raise ConfigError(
                "dispatch_chunk_avg_tokens", self.dispatch_chunk_avg_tokens, "a power of two >= 8"
            )
        if self.mode == "substitute" and self.exact_materialization_only:
            raise ConfigError(
                "mode",
                self.mode,
                "discovery_only or exact_spans while exact_materialization_only is true "
                "(set SEMBLEND_EXACT_MATERIALIZATION_ONLY=0 for substitute)",
            )

    @property
    def discovery_only(self) -> bool:
        """True in discovery_only mode: lookups and telemetry only, nothing is materialized."""
        return self.mode == "discovery_only"

    @staticmethod
    def _env_layer(environ: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
        layer: dict[str, Any] = {}
        unknown: list[str] = []
        for key in sorted(environ):
            if not key.startswith(ENV_PREFIX) or key in OTHER_SEMBLEND_ENV:
                continue
            spec = FIELDS_BY_ENV.get(key)
            if spec is None:
                unknown.append(key)
                _warn_once(f"unknown environment variable {key} ignored (not a SemBlend setting)")
                continue
            layer[spec.name] = parse_value(spec, environ[key], key)
        keys = {f.name: f.env for f in FIELDS}
        return _resolve_layer(layer, keys), unknown

    @staticmethod
    def _json_layer(obj: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        if not isinstance(obj, Mapping):
            raise ConfigError("kv_connector_extra_config", obj, "a JSON object")
        layer: dict[str, Any] = {}
        names: dict[str, str] = {}
        unknown: list[str] = []
        for key in sorted(obj):
            spec = _JSON_KEYS.get(key)
            if spec is None:
                unknown.append(key)
                _warn_once(f"unknown SemBlend JSON key {key!r} ignored")
                continue
            if spec.name in layer:
                raise ConfigError(key, obj[key], f"only one of {names[spec.name]!r} and {key!r}")
            layer[spec.name] = parse_value(spec, obj[key], key)
            names[spec.name] = key
        keys = {f.name: names.get(f.name, f.name) for f in FIELDS}
        return _resolve_layer(layer, keys), unknown

    @staticmethod
    def _cli_layer(cli: Mapping[str, Any]) -> dict[str, Any]:
        layer: dict[str, Any] = {}
        for key in sorted(cli):
            value = cli[key]
            if value is None:  # click passes None for flags that were not given
                continue
            spec = FIELDS_BY_FLAG.get(key) or FIELDS_BY_NAME.get(key.replace("-", "_"))
            if spec is None and key.startswith("semblend_"):
                spec = FIELDS_BY_NAME.get(key[len("semblend_") :])
            if spec is None:
                raise ConfigError(key, value, "a --semblend-* flag listed in config.FIELDS")
            layer[spec.name] = parse_value(spec, value, spec.flag)
        keys = {f.name: f.flag for f in FIELDS}
        return _resolve_layer(layer, keys)

    @classmethod
    def from_sources(
        cls,
        *,
        env: Mapping[str, str] | None = None,
        json_obj: Mapping[str, Any] | None = None,
        cli: Mapping[str, Any] | None = None,
    ) -> Config:
        """Merge defaults < ``env`` < ``json_obj`` < ``cli`` into one validated Config.

        ``env``: a mapping of environment variables (pass ``os.environ`` explicitly; None means
        no environment source). ``json_obj``: the ``kv_connector_extra_config`` object. ``cli``:
        flag values keyed by flag (``--semblend-min-similarity``), field name, or click parameter
        name (``semblend_min_similarity``); None values mean "not given". Raises ConfigError.
        """
        merged: dict[str, Any] = {}
        unknown: list[str] = []
        if env is not None:
            layer, unk = cls._env_layer(env)
            merged.update(layer)
            unknown += unk
        if json_obj is not None:
            layer, unk = cls._json_layer(json_obj)
            merged.update(layer)
            unknown += unk
        if cli is not None:
            merged.update(cls._cli_layer(cli))
        return replace(cls(), **merged, unknown_keys=tuple(unknown))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """Config from the SEMBLEND_* variables of ``environ`` (default: os.environ)."""
        return cls.from_sources(env=os.environ if environ is None else environ)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Config:
        """Config from a ``kv_connector_extra_config`` object over defaults (no environment)."""
        return cls.from_sources(json_obj=obj)

    def as_dict(self) -> dict[str, Any]:
        """Field values by name (``unknown_keys`` excluded), e.g. for logging."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "unknown_keys"}


def cli_options() -> list[dict[str, Any]]:
    """One dict per field for a CLI launcher: flag, env, name, type, default, help, choices,
    allowed. Boolean flags take a value (``--semblend-enabled 0``) so every flag can override."""
    return [
        {
            "name": spec.name,
            "flag": spec.flag,
            "env": spec.env,
            "type": spec.type,
            "default": spec.default,
            "help": spec.help,
            "choices": spec.choices,
            "allowed": spec.allowed(),
        }
        for spec in FIELDS
    ]
