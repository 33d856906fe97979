"""One validated :class:`Config` from SEMBLEND_* environment variables, a JSON object and CLI flags.

Every setting is declared once, as a field of :class:`Config` (its default, help text, bounds and
choices: :func:`~.config_fields.setting`); :data:`FIELDS` is derived from those declarations,
plus the ``discovery_only`` shorthand, and gives each its env var, ``--semblend-*`` flag and JSON
keys for the launcher, ``semblend-sglang settings`` and the table in docs/provider.md.

Precedence (lowest to highest): built-in defaults < environment < JSON object
(vLLM ``kv_connector_extra_config``) < CLI flags. Each source is validated on its own; a bad value
raises :class:`ConfigError` naming the key, the value and what is allowed. Unknown SEMBLEND_*
variables and unknown JSON keys are logged once and listed in ``Config.unknown_keys``.

``discovery_only`` is a source-level shorthand for ``mode=discovery_only``
(:mod:`.discovery_shorthand`).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .config_fields import (
    ENV_PREFIX,
    ConfigError,
    FieldSpec,
    SourceFields,
    is_choice_enum,
    markdown_table,
    parse_value,
    setting,
    specs_of,
)
from .discovery_shorthand import resolve_discovery_only, with_discovery_only
from .presets import DEFAULT_PRESET, PRESETS, TUNING_SETTINGS
from .recompute_strategy import RecomputeStrategy, ReuseMode

__all__ = [
    "EMBEDDERS",
    "ENV_PREFIX",
    "FIELDS",
    "FIELDS_BY_ENV",
    "FIELDS_BY_FLAG",
    "FIELDS_BY_NAME",
    "MODES",
    "Config",
    "ConfigError",
    "FieldSpec",
    "cli_options",
    "parse_value",
    "settings_table",
]

MODES = tuple(ReuseMode)
SPARSE_PATHS = ("auto", "split_view", "position_mask")
EMBEDDERS = ("minilm", "jaccard", "none")

OTHER_SEMBLEND_ENV = frozenset({"SEMBLEND_MODEL_CACHE"})
"""SEMBLEND_* variables owned by other parts of the project (not Config fields, not unknown)."""


@dataclass(frozen=True, slots=True)
class Config:
    """Validated SemBlend settings; build with :meth:`from_env`, :meth:`from_json`,
    :meth:`from_sources` (never raise from the engine: build it at start-up).

    Each field below is the one declaration of its setting (``semblend-sglang settings`` lists
    them with their env vars and flags)."""

    enabled: bool = setting(
        True, "Enable semantic donor lookup (0: every lookup declines, disabled)."
    )
    mode: ReuseMode = setting(
        ReuseMode.EXACT_SPANS,
        "discovery_only: lookup + telemetry only; exact_spans: reuse token-identical spans; "
        "substitute: SemBlend-style, changes the prompt (needs exact_materialization_only=0).",
    )
    model_id: str = setting("", "Model identity recorded in the namespace (informational).")
    min_similarity: float = setting(
        0.60,
        "Minimum embedding cosine similarity (substitute mode gate, discovery telemetry).",
        minimum=0.0,
        maximum=1.0,
    )
    embedder: str = setting(
        "minilm",
        "Similarity for the substitute gate: minilm (sentence-transformers all-MiniLM-L6-v2), "
        "jaccard (token-chunk sketch), none.",
        choices=EMBEDDERS,
        json_aliases=("embedder_type",),
    )
    strict_prefix_boundary: bool = setting(
        False,
        "Plan one span from one donor (SemBlend-compatible) instead of up to max_spans spans.",
    )
    max_plan_donors: int = setting(
        8,
        "Donors whose spans one plan may combine (1: one donor per plan).",
        minimum=1,
        maximum=64,
    )
    keep_reused_donors: bool = setting(
        True,
        "Keep the unpublished prompt KV of a request that reused KV as donor KV outside SGLang's "
        "tree (evicted before the tree) instead of freeing it (SGLang 0.5.22+; docs/sglang.md).",
    )
    report_reuse_to_client: bool = setting(
        False,
        "Add semantically reused tokens to the client-visible cached_tokens (off: clients see "
        "SGLang's exact prefix hit only; docs/security.md).",
    )
    exact_materialization_only: bool = setting(
        True, "Materialize only token-identical spans (must be 0 for mode=substitute)."
    )
    min_prompt_tokens: int = setting(
        256, "Prompts shorter than this are declined (prompt_too_short).", minimum=0
    )
    exact_sufficient_ratio: float = setting(
        0.90,
        "Exact route when the exact prefix hit covers at least this fraction of the prompt.",
        minimum=0.0,
        maximum=1.0,
    )
    min_reuse_tokens: int = setting(
        128, "Minimum reused tokens of a plan (after trimming).", minimum=1
    )
    min_reuse_ratio: float = setting(
        0.25,
        "Minimum reused tokens / tokens not covered by the exact hit.",
        minimum=0.0,
        maximum=1.0,
    )
    sink_tokens: int = setting(
        4, "Tokens recomputed at the start of each reused span (attention-sink effect).", minimum=0
    )
    preset: str = setting(
        DEFAULT_PRESET,
        "Named repair settings (quality: two checks of multi-span plans; fast: one check); "
        "a preset fills the repair settings no source sets, and a request may choose its own "
        "(custom_params.semblend_reuse, docs/sglang.md).",
        choices=tuple(PRESETS),
    )
    recompute_strategy: RecomputeStrategy = setting(
        RecomputeStrategy.DEVIATION,
        "Which reused positions are recomputed: heads (first tokens of each span), deviation "
        "(largest K/V deviation from the donor at the check layer), query (most attended by "
        "the prompt's last tokens at the check layer).",
    )
    recompute_ratio: float = setting(
        0.15,
        "Fraction of a request's reused tokens recomputed in its one-pass extend (0: none).",
        minimum=0.0,
        maximum=1.0,
    )
    recompute_check_layer: int = setting(
        1,
        "deviation/query: layers up to this one compute every position; the selection is made "
        "at it and only the selected reused positions are computed after it.",
        minimum=0,
    )
    recompute_recheck_depth: float = setting(
        0.5,
        "deviation/query: plans of more than recompute_check_max_spans spans are checked "
        "twice: the check layer keeps recompute_recheck_width times the budget, computed up to "
        "the layer at this fraction of the model's depth, where their K/V deviation keeps the "
        "budget, recompute_min_deviation not applying (0: one check; a layer not after the "
        "check layer and before the last is named at start-up and not used).",
        minimum=0.0,
        maximum=1.0,
    )
    recompute_recheck_width: float = setting(
        3.0,
        "deviation/query: with recompute_recheck_depth, the first check keeps this many times "
        "the budget (capped at every candidate).",
        minimum=1.0,
        maximum=100.0,
    )
    recompute_check_share: float = setting(
        0.15,
        "deviation/query: share of the reused positions of a plan with at most "
        "recompute_check_max_spans spans computed up to the check layer and scored there (every "
        "span's first token, then evenly spread); the others keep the donor's KV from the first "
        "layer on and are never recomputed (1: a dense check).",
        minimum=0.01,
        maximum=1.0,
    )
    recompute_check_max_spans: int = setting(
        1,
        "deviation/query: plans of at most this many spans take the sampled check "
        "(recompute_check_share); plans of more spans, and every plan while quality_gate is "
        "set, are checked on every reused position (0: no plan is sampled).",
        minimum=0,
        maximum=4096,
    )
    recompute_check_span_limit: int = setting(
        128,
        "deviation/query: at most this many positions of each copied span of a sampled plan "
        "are checked (its first, then evenly spread), so the check's cost follows the plan and "
        "not the prompt's length (0: no limit, recompute_check_share alone).",
        minimum=0,
        maximum=1 << 20,
    )
    recompute_min_deviation: float = setting(
        1e-4,
        "deviation/query: recompute a reused position only when its relative K/V deviation at "
        "the check layer is at least this, so the ratio is a per-request ceiling (0: the ratio "
        "is spent on every request).",
        minimum=0.0,
    )
    quality_gate: float = setting(
        0.0,
        "deviation/query: recompute every reused position (declined:quality_gate) when the mean "
        "relative K/V deviation of those left after the budget exceeds this (0: off).",
        minimum=0.0,
    )
    sparse_path: str = setting(
        "auto",
        "triton: how a batch holding a sparse request is attended: auto (the split view when its "
        "tile work is no larger, else the position mask), split_view or position_mask (a check "
        "of one path against the other; the sparse_extend_batches counters show which ran). "
        "Other backends have one path and ignore it.",
        choices=SPARSE_PATHS,
    )
    max_spans: int = setting(
        8, "Maximum spans in one plan (1 when strict_prefix_boundary).", minimum=1, maximum=4096
    )
    min_span_tokens: int = setting(
        32, "Minimum length of an aligned identical span.", minimum=2, maximum=65536
    )
    max_donors: int = setting(
        20000, "Donors kept in the index (least recently used evicted first).", minimum=1
    )
    max_index_bytes: int = setting(
        512 * 1024 * 1024,
        "Bytes the donor index may hold: live postings (12 B each), records (320 B) and token "
        "copies (4 B per token) of the donors; the least recently used are dropped beyond it.",
        minimum=1024 * 1024,
    )
    max_candidates: int = setting(
        8, "Donor candidates aligned per lookup, best first.", minimum=1, maximum=64
    )
    lookup_budget_ms: float = setting(
        5.0,
        "Work budget of one lookup in milliseconds of the reference CPU, counted in operations "
        "so that every rank decides alike; a lookup that runs out with no plan declines "
        "(lookup_budget).",
        minimum=0.01,
        maximum=10000.0,
    )
    min_candidate_tokens: int = setting(
        32, "Minimum shared-chunk tokens for a donor to be aligned at all.", minimum=1
    )
    chunk_avg_tokens: int = setting(
        16, "Average content-defined chunk length (power of two).", minimum=8, maximum=4096
    )
    embed_discovery: bool = setting(
        False, "In discovery_only mode, also embed query and donor and record their similarity."
    )
    dispatch_enabled: bool = setting(
        True,
        "With --dp-size N: send each request to the data-parallel rank holding its donor "
        "(docs/scale-out.md).",
    )
    dispatch_load_margin: int = setting(
        8192,
        "Tokens a donor's rank may be loaded above the least-loaded rank and still be chosen; "
        "beyond it SGLang's own dispatch method decides.",
        minimum=0,
    )
    dispatch_index_bytes: int = setting(
        64 * 1024 * 1024,
        "Byte bound of the dispatcher's index of what went to which rank.",
        minimum=1024 * 1024,
    )
    dispatch_chunk_avg_tokens: int = setting(
        64,
        "Average content-defined chunk length (power of two) of the dispatcher's index; "
        "coarser than the provider's: a rank needs evidence, not alignment (bench dispatch).",
        minimum=8,
        maximum=4096,
    )
    dispatch_expire_ratio: float = setting(
        1.0,
        "A dispatch entry expires once its rank was sent this many times its KV pool size in "
        "tokens since.",
        minimum=0.01,
        maximum=1000.0,
    )
    unknown_keys: tuple[str, ...] = field(default=(), compare=False)
    """SEMBLEND_* env vars and JSON keys that name no field (reported, not applied)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            spec = FIELDS_BY_NAME.get(f.name)
            if spec is not None:
                value = parse_value(spec, getattr(self, f.name), f.name)
                if value is not getattr(self, f.name) and is_choice_enum(spec.type):
                    object.__setattr__(self, f.name, value)  # a choice given as its string
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
        name (``semblend_min_similarity``); None values mean "not given". The ``preset``'s
        repair settings (:data:`~.presets.PRESETS`) fill those no source sets. Raises
        ConfigError.
        """
        merged, unknown = SOURCES.merge(env, json_obj, cli)
        for name, value in PRESETS[merged.get("preset", DEFAULT_PRESET)].items():
            merged.setdefault(name, value)
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
        """Field values by name (``unknown_keys`` excluded; a choice as its plain string), e.g.
        for logging and the server's JSON state."""
        return {
            f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name != "unknown_keys"
        }


def _plain(value: Any) -> Any:
    """``value`` with a choice enum member replaced by its string."""
    return value.value if isinstance(value, enum.StrEnum) else value


FIELDS: tuple[FieldSpec, ...] = tuple(
    replace(spec, tuning=spec.name in TUNING_SETTINGS)
    for spec in with_discovery_only(list(specs_of(Config)))
)
"""Every setting a source may set: the Config fields in declaration order, with
``discovery_only`` after ``mode``."""
SOURCES = SourceFields(FIELDS, resolve_discovery_only, OTHER_SEMBLEND_ENV)
"""How each source names the settings (``Config.from_sources``)."""
FIELDS_BY_NAME: dict[str, FieldSpec] = SOURCES.by_name
FIELDS_BY_ENV: dict[str, FieldSpec] = SOURCES.by_env
FIELDS_BY_FLAG: dict[str, FieldSpec] = SOURCES.by_flag


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


def settings_table() -> str:
    """The markdown table of every setting (:data:`FIELDS`) that docs/provider.md holds."""
    return markdown_table(FIELDS)
