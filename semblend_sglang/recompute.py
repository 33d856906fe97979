"""Which reused positions a one-pass extend recomputes, and when reuse is refused outright.

Reused KV was computed after the donor's context, not the request's. A *recompute budget* of
``ratio`` times the reused tokens is spent on the positions whose donor KV matters most; the
rest keep the donor's KV. Strategies (:class:`RecomputeStrategy`):

- ``heads``: the first tokens of every span (EPIC-style), as equal a share per span as the span
  lengths allow (:func:`head_lengths`). Decided in the scheduler; no model hook.
- ``deviation``: every position is computed up to a *check layer*; the reused positions whose
  fresh K/V deviate most from the donor's there are recomputed in the layers after it
  (CacheBlend-style; :func:`kv_deviation`).
- ``query``: as ``deviation``, ranked instead by the attention the request's last computed
  tokens pay each reused key at the check layer (ProphetKV-style; :func:`query_attention`).

With a *check share* below 1 only a sample of a plan's reused positions (:func:`check_sample`)
is computed up to the check layer and scored, for plans of few spans (:class:`CheckSampling`),
at most a *span limit* of positions per span when one is set, so that the check's cost follows
the plan rather than the prompt's length; the others keep the donor's KV in every layer, and the
budget, still a share of every reused position, is spent on the sample.

With a *minimum deviation* the budget is per request (:func:`select`): only reused positions
whose K/V moved at least that much at the check layer are recomputed, up to the ratio, so spans
that behave like an exact prefix cost nothing after the check layer.

The *quality gate* (:func:`gate`) looks at what stays approximate after the selection: when the
mean deviation of the reused positions left unrecomputed exceeds the threshold, every one of them
is recomputed (the request ends ``declined:quality_gate``).

Pure tensor functions with a deterministic order (ties broken by position), so ranks fed the
same scores select the same positions. Engine hooks live in ``patches/``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import Config
from .recompute_strategy import RecomputeStrategy as RecomputeStrategy

QUERY_TAIL_TOKENS = 32
"""``query``: the last computed tokens of a request whose attention ranks its reused keys."""


@dataclass(frozen=True, slots=True)
class Selection:
    """One request's outcome at the check layer.

    ``recompute``: indices into the request's candidates (ascending) recomputed after the check
    layer; ``gated``: the quality gate made that every candidate; ``residual_deviation``: mean
    deviation of the candidates left unrecomputed by the budget (before the gate; 0 when none).
    """

    recompute: torch.Tensor
    gated: bool
    residual_deviation: float


def budget(reused: int, ratio: float) -> int:
    """Positions recomputed out of ``reused``: ``ceil(ratio * reused)``, at most ``reused``."""
    if reused <= 0 or ratio <= 0.0:
        return 0
    return min(reused, math.ceil(ratio * reused - 1e-9))


def head_lengths(span_lengths: Sequence[int], ratio: float) -> list[int]:
    """``heads``: how many leading tokens of each span are recomputed.

    The budget (:func:`budget` of the spans' total) goes to every span alike (the smallest
    ``k`` with ``sum(min(k, len))`` at least the budget); the spans that cannot take ``k``
    take all they have. The total may exceed the budget by fewer tokens than there are spans.
    """
    total = budget(sum(span_lengths), ratio)
    if total == 0:
        return [0] * len(span_lengths)
    lo, hi = 0, max(span_lengths)
    while lo < hi:  # smallest k whose capped sum reaches the budget
        k = (lo + hi) // 2
        if sum(min(k, n) for n in span_lengths) >= total:
            hi = k
        else:
            lo = k + 1
    return [min(lo, n) for n in span_lengths]


@dataclass(frozen=True, slots=True)
class CheckSampling:
    """Which plans a check computes on a sample: those of at most ``max_spans`` spans, on
    ``share`` of their reused positions and at most ``span_limit`` positions of each span (0: no
    limit) (``recompute_check_share``, ``recompute_check_max_spans``,
    ``recompute_check_span_limit``). Built once per server from its settings; the quality gate
    needs every position scored, so a server with the gate on samples no plan."""

    share: float = 1.0
    max_spans: int = 0
    span_limit: int = 0

    @classmethod
    def of(cls, config: Config) -> CheckSampling:
        """The sampling of a server with these settings."""
        if config.quality_gate > 0.0 or config.recompute_check_share >= 1.0:
            return cls()
        return cls(
            config.recompute_check_share,
            config.recompute_check_max_spans,
            config.recompute_check_span_limit,
        )

    def share_for(self, spans: int) -> float:
        """The share of a plan of ``spans`` spans computed up to the check layer (1: all)."""
        return self.share if spans <= self.max_spans else 1.0

    def sample(self, spans: int, length: int) -> torch.Tensor:
        """:func:`check_sample` of one copied span of ``length`` positions in a plan of
        ``spans`` spans: the span limit applies to sampled plans only (a dense check scores
        every position)."""
        share = self.share_for(spans)
        return check_sample(length, share, self.span_limit if share < 1.0 else 0)


def recheck_layer(depth: float, check_layer: int, layers: int) -> int | None:
    """The layer of the second check (``recompute_recheck_depth``) of a model of ``layers``
    layers: ``round(depth * layers)``, or None when ``depth`` is 0 or that layer is not after
    ``check_layer`` and before the last (a second check there could select nothing new)."""
    if depth <= 0.0:
        return None
    layer = round(depth * layers)
    return layer if check_layer < layer < layers - 1 else None


def check_sample(length: int, share: float, limit: int = 0) -> torch.Tensor:
    """Offsets into a span of ``length`` reused positions computed up to the check layer when
    only ``share`` of them are: ``ceil(m / share)`` for ``m = 0, 1, ...`` below ``length`` (the
    span's first position, then one every ``1 / share``), CPU int64 ascending; all of them at
    ``share`` 1. With ``limit`` > 0 and more than ``limit`` offsets that way, ``limit`` offsets
    instead: ``ceil(m * length / limit)`` for ``m < limit`` (the first position, then evenly
    spread)."""
    if length <= 0:
        return torch.empty(0, dtype=torch.int64)
    if share >= 1.0:
        return torch.arange(length, dtype=torch.int64)
    count = math.ceil(length * share - 1e-9)
    if 0 < limit < count:
        spread = torch.arange(limit, dtype=torch.float64) * (length / limit)
        return torch.ceil(spread - 1e-9).to(torch.int64)
    offsets = torch.ceil(torch.arange(count, dtype=torch.float64) / share - 1e-9).to(torch.int64)
    return offsets[offsets < length]


def kv_deviation(
    k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (first dimension), the squared K/V deviation ``|k_new - k_old|^2 +
    |v_new - v_old|^2`` and the squared norm ``|k_new|^2 + |v_new|^2``, summed over every other
    dimension (heads, head dim), in float32. Separate so that tensor-parallel ranks, each with
    some heads, can sum both before :func:`relative`."""
    n = k_new.shape[0]
    kn, vn = k_new.reshape(n, -1).float(), v_new.reshape(n, -1).float()
    ko, vo = k_old.reshape(n, -1).float(), v_old.reshape(n, -1).float()
    diff = (kn - ko).square().sum(1) + (vn - vo).square().sum(1)
    norm = kn.square().sum(1) + vn.square().sum(1)
    return diff, norm


def relative(diff: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """``diff / norm`` per token (0 where the norm is 0)."""
    return torch.where(norm > 0, diff / norm.clamp_min(1e-30), torch.zeros_like(diff))


def query_attention(
    q_tail: torch.Tensor, k_candidates: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``query``: the mean softmax attention (over the candidates) that each query in ``q_tail``
    ([t, Hq, D]) pays each key in ``k_candidates`` ([n, Hkv, D]), averaged over queries and
    query heads (grouped heads share their KV head); shape [n], float32. Every tail query sits
    after every candidate, so no mask applies."""
    t, hq, d = q_tail.shape
    n, hkv, _ = k_candidates.shape
    if n == 0 or t == 0:
        return torch.zeros(n, dtype=torch.float32, device=k_candidates.device)
    q = q_tail.float().reshape(t, hkv, hq // hkv, d)
    k = k_candidates.float()
    logits = torch.einsum("tgrd,ngd->tgrn", q, k) * scaling
    return logits.softmax(dim=-1).mean(dim=(0, 1, 2))


def top(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` highest scores, ascending; equal scores go to the earlier
    index (deterministic on every device)."""
    if count <= 0:
        return torch.empty(0, dtype=torch.int64, device=scores.device)
    if count >= scores.numel():
        return torch.arange(scores.numel(), dtype=torch.int64, device=scores.device)
    order = torch.sort(-scores.float(), stable=True).indices[:count]
    return torch.sort(order).values.to(torch.int64)


def gate(deviation: torch.Tensor, chosen: torch.Tensor, threshold: float) -> tuple[bool, float]:
    """(refuse, residual): the mean of ``deviation`` over the candidates not in ``chosen``, and
    whether it exceeds ``threshold`` (never when ``threshold`` is 0, the gate being off)."""
    keep = torch.ones(deviation.numel(), dtype=torch.bool, device=deviation.device)
    keep[chosen] = False
    if not bool(keep.any()):
        return False, 0.0
    residual = float(deviation[keep].float().mean())
    return threshold > 0.0 and residual > threshold, residual


def select(
    scores: torch.Tensor,
    deviation: torch.Tensor,
    ratio: float,
    threshold: float,
    min_deviation: float = 0.0,
    reused: int | None = None,
) -> Selection:
    """One request's :class:`Selection`: the top :func:`budget` candidates by ``scores``, or
    every candidate when :func:`gate` on ``deviation`` refuses what is left. ``reused``: the
    request's reused positions the budget is a share of when the candidates are a sample of
    them (:func:`check_sample`; the budget is then at most the candidates); None: the
    candidates are all of them.

    With ``min_deviation`` > 0 the budget is per request: only candidates whose ``deviation``
    is at least ``min_deviation`` may be chosen, so a request whose reused KV barely moved pays
    nothing and ``ratio`` becomes a ceiling."""
    candidates = int(scores.numel())
    count = min(candidates, budget(candidates if reused is None else reused, ratio))
    if min_deviation > 0.0:
        eligible = deviation >= min_deviation
        count = min(count, int(eligible.sum()))
        scores = torch.where(eligible, scores.float(), torch.full_like(scores.float(), -1.0))
    chosen = top(scores, count)
    refused, residual = gate(deviation, chosen, threshold)
    if refused:
        chosen = torch.arange(scores.numel(), dtype=torch.int64, device=scores.device)
    return Selection(chosen, refused, residual)
