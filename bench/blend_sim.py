"""``bench blend-sim``: which recompute selection keeps the cold answer, measured without a server.

An offline float32 torch forward of a Llama or Qwen2 checkpoint (:class:`.LlamaReference`) runs a
workload's probe cold, its donors, and then the probe as a recompute would: every position
computed up to the check layer, after it only the gaps and the selected reused positions, the
rest attending with their donor's RoPE-corrected K/V (:func:`blended_prefill`, the dense
reference of ``patches/sglang/flow/check_layer.py``). Per probe it prints, for each selection and
ratio, the 32-token greedy agreement with cold:

- ``deviation@c``: the top ratio of reused positions by relative K/V deviation at check layer
  ``c`` (the engine's ``deviation`` strategy);
- ``deep@c``: the top ratio by the deviation summed over the layers after ``c``, which only a
  cold prefill knows (what a check at every layer would see): whether the check layer's signal
  is too shallow. It is not an optimum: the positions that change the answer most need not be
  the ones whose K/V deviate most.
- ``question``: the top ratio by the attention the prompt's last
  :data:`~semblend_sglang.recompute.QUERY_TAIL_TOKENS` positions pay each reused position (all
  layers and heads) in a pass where every reused position keeps its donor's K/V, recomputed
  from layer 0 (QCFuse-, ProphetKV-like); ``question@c``: that ranking after check layer ``c``;
- ``window@c``: the deviation at ``c`` of one position per :data:`WINDOW` (a sampled check),
  each window chosen whole by it and recomputed from layer 0;
- ``staged@c``: a check in two stages (CacheBlend's gradual filtering; the server's
  ``recompute_recheck_depth``): the deviation at :data:`FIRST_STAGE_LAYER` (every position
  computed through it) keeps ``recompute_recheck_width`` (its default) times the budget,
  computed up to ``c``; there the deviation of those (their K/V recomputed beside donor K/V)
  keeps the budget, computed after ``c``.

Reused positions are each shared passage of the group (``RequestGroup.shared_spans``) found in
the probe and in the first donor that has it. Measurement only: nothing in serving imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import click
import torch

from semblend_sglang import recompute
from semblend_sglang.config import Config
from semblend_sglang.kernels.rotate_ref import rotate_fp32

from .blend_sim_flags import (
    SELECTIONS,
    parse_check_layers,
    parse_group_indices,
    parse_ratios,
    parse_selections,
    parse_workloads,
)
from .e2e_runner import GREEDY_TOKENS
from .llama_reference import AttentionWatch, LlamaReference, Prefill
from .metrics import greedy_agreement

WINDOW = 8
"""``window@c``: reused positions per sampled one (the check's sample is 1 in ``WINDOW``)."""


FIRST_STAGE_LAYER = 1
"""``staged@c``: the layer of the first, dense stage."""


def windowed(score: torch.Tensor, window: int) -> torch.Tensor:
    """Each position's score replaced by the score of the first position of its ``window``
    (positions ``0, window, 2 * window, ...`` are the sample), so :func:`recompute.top` takes
    windows whole, in order of their sampled score."""
    sampled = torch.arange(score.numel()) // window * window
    return score[sampled]


@torch.no_grad()
def blended_prefill(
    model: LlamaReference,
    cold: Prefill,
    donor_keys: list[torch.Tensor],
    donor_values: list[torch.Tensor],
    keep_donor: torch.Tensor,
    check_layer: int,
    watch_tail: int = 0,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The prompt of ``cold`` as a recompute runs it: cold through ``check_layer`` (every
    position computed there; -1: none), then the positions ``keep_donor`` keep the donor's K/V
    (rows of ``donor_keys``/``donor_values``, RoPE-corrected to the prompt's positions) and only
    the others are computed. Returns the per-layer K/V, the last position's final hidden state
    (the last position must not be in ``keep_donor``) and the attention the last ``watch_tail``
    computed positions pay every position, summed over the layers after ``check_layer``
    (:class:`AttentionWatch`; zeros when ``watch_tail`` is 0)."""
    n = cold.keys[0].shape[0]
    computed = _computed(n, keep_donor, torch.zeros(0, dtype=torch.long))
    rows = torch.nonzero(computed).flatten()
    keys = [k.clone() for k in cold.keys]
    values = [v.clone() for v in cold.values]
    tail = torch.arange(max(0, rows.numel() - watch_tail), rows.numel())
    watch = AttentionWatch(tail, torch.zeros(n)) if watch_tail > 0 else None
    hidden = _run_layers(
        model,
        cold.hidden[check_layer + 1][rows],
        computed,
        (keys, values),
        (donor_keys, donor_values),
        range(check_layer + 1, model.layers),
        watch,
    )
    return keys, values, hidden[-1], watch.total if watch is not None else torch.zeros(n)


@torch.no_grad()
def staged_prefill(
    model: LlamaReference,
    cold: Prefill,
    donor_keys: list[torch.Tensor],
    donor_values: list[torch.Tensor],
    positions: torch.Tensor,
    first_score: torch.Tensor,
    second_layer: int,
    ratio: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """``staged@second_layer``: cold through :data:`FIRST_STAGE_LAYER`; the top
    :func:`~semblend_sglang.recompute.budget` of ``ratio`` times the default
    ``recompute_recheck_width`` of ``positions`` by ``first_score`` computed up to
    ``second_layer`` (the others keep donor K/V from the layer after the first stage); there the
    budget of ``ratio`` of those, by their K/V deviation from the donor's, computed after it.
    Returns the per-layer K/V and the last position's final hidden state."""
    n = cold.keys[0].shape[0]
    count = recompute.budget(len(positions), ratio)
    width = Config().recompute_recheck_width
    wide = positions[recompute.top(first_score, recompute.budget(len(positions), ratio * width))]
    keys = [k.clone() for k in cold.keys]
    values = [v.clone() for v in cold.values]
    kv, donor = (keys, values), (donor_keys, donor_values)
    computed = _computed(n, positions, wide)
    rows = torch.nonzero(computed).flatten()
    hidden = _run_layers(
        model,
        cold.hidden[FIRST_STAGE_LAYER + 1][rows],
        computed,
        kv,
        donor,
        range(FIRST_STAGE_LAYER + 1, second_layer + 1),
    )
    score = torch.zeros(0)
    if wide.numel():
        score = recompute.relative(
            *recompute.kv_deviation(
                keys[second_layer][wide],
                values[second_layer][wide],
                donor_keys[second_layer][wide],
                donor_values[second_layer][wide],
            )
        )
    narrow = _computed(n, positions, wide[recompute.top(score, count)])
    hidden = _run_layers(
        model, hidden[narrow[rows]], narrow, kv, donor, range(second_layer + 1, model.layers)
    )
    return keys, values, hidden[-1]


def _computed(n: int, reused: torch.Tensor, recomputed: torch.Tensor) -> torch.Tensor:
    """[n] True where a position is computed: not ``reused``, or ``recomputed``."""
    computed = torch.ones(n, dtype=torch.bool)
    computed[reused] = False
    computed[recomputed] = True
    return computed


def _run_layers(
    model: LlamaReference,
    hidden: torch.Tensor,
    computed: torch.Tensor,
    kv: tuple[list[torch.Tensor], list[torch.Tensor]],
    donor: tuple[list[torch.Tensor], list[torch.Tensor]],
    layers: range,
    watch: AttentionWatch | None = None,
) -> torch.Tensor:
    """``layers`` over ``hidden`` (the ``computed`` rows): the other positions' K/V in ``kv``
    become ``donor``'s in each of them. Returns the hidden states after the last."""
    rows = torch.nonzero(computed).flatten()
    on_donor = ~computed
    keys, values = kv
    for index in layers:
        keys[index][on_donor] = donor[0][index][on_donor]
        values[index][on_donor] = donor[1][index][on_donor]
        hidden = model.layer(index, hidden, rows, rows, keys[index], values[index], watch)
    return hidden


def _find(haystack: Sequence[int], needle: Sequence[int]) -> int | None:
    n = len(needle)
    for i in range(len(haystack) - n + 1):
        if haystack[i : i + n] == needle:
            return i
    return None


def simulate_group(
    model: LlamaReference,
    probe: Sequence[int],
    donors: Sequence[Sequence[int]],
    passages: Sequence[Sequence[int]],
    ratios: Sequence[float],
    check_layers: Sequence[int],
    kinds: Sequence[str] = SELECTIONS,
) -> tuple[list[float], list[tuple[str, float, float]]]:
    """The cold margins of ``probe``'s greedy answer and, per (selection, ratio), its greedy
    agreement with cold (:func:`.metrics.greedy_agreement`; selections in the module doc, those
    of ``kinds`` only).
    Raises ValueError when a passage is missing from the probe or from every donor, or a check
    layer is not a layer of ``model``."""
    if any(not 0 <= c < model.layers for c in check_layers):
        raise ValueError(f"check layers {list(check_layers)} not all in [0, {model.layers})")
    cold = model.prefill(probe)
    answer, margins = model.greedy(cold.keys, cold.values, cold.hidden[-1][-1], GREEDY_TOKENS)
    n = len(probe)
    donor_keys = [torch.zeros_like(k) for k in cold.keys]
    donor_values = [torch.zeros_like(v) for v in cold.values]
    computed_donors: dict[int, Prefill] = {}
    reused = []
    for passage in passages:
        at = _find(probe, passage)
        found = [(i, _find(d, passage)) for i, d in enumerate(donors)]
        source = next(((i, s) for i, s in found if s is not None), None)
        if at is None or source is None:
            raise ValueError("a shared passage is missing from the probe or from every donor")
        i, start = source
        if i not in computed_donors:
            computed_donors[i] = model.prefill(donors[i])
        src = torch.arange(start, start + len(passage))
        dst = torch.arange(at, at + len(passage))
        for index in range(model.layers):
            k = computed_donors[i].keys[index][src]
            donor_keys[index][dst] = rotate_fp32(k, dst - src, model.rope)
            donor_values[index][dst] = computed_donors[i].values[index][src]
        reused.append(dst)
    positions = torch.cat(reused)
    if int(positions.max()) >= n - 1:
        raise ValueError("the probe's last position is reused: nothing would compute it")
    deviation = [
        recompute.relative(
            *recompute.kv_deviation(
                cold.keys[i][positions],
                cold.values[i][positions],
                donor_keys[i][positions],
                donor_values[i][positions],
            )
        )
        for i in range(model.layers)
    ]
    paid = torch.zeros(n)
    if "question" in kinds:
        *_, paid = blended_prefill(
            model, cold, donor_keys, donor_values, positions, -1, recompute.QUERY_TAIL_TOKENS
        )
    selections: list[tuple[str, torch.Tensor, int]] = []
    for check in check_layers:
        selections.append((f"deviation@{check}", deviation[check], check))
        deep = sum(deviation[check + 1 :], torch.zeros(len(positions)))
        selections.append((f"deep@{check}", deep, check))
        selections.append((f"question@{check}", paid[positions], check))
        selections.append((f"window@{check}", windowed(deviation[check], WINDOW), -1))
    selections.append(("question", paid[positions], -1))
    results = []
    for name, score, start in (s for s in selections if s[0].split("@")[0] in kinds):
        for ratio in ratios:
            chosen = recompute.top(score, recompute.budget(len(positions), ratio))
            kept = torch.ones(len(positions), dtype=torch.bool)
            kept[chosen] = False
            keys, values, last, _ = blended_prefill(
                model, cold, donor_keys, donor_values, positions[kept], start
            )
            tokens, _ = model.greedy(keys, values, last, GREEDY_TOKENS)
            results.append((name, ratio, greedy_agreement(tokens, answer, GREEDY_TOKENS)))
    for check in check_layers:
        if "staged" not in kinds or check <= FIRST_STAGE_LAYER:
            continue
        for ratio in ratios:
            keys, values, last = staged_prefill(
                model,
                cold,
                donor_keys,
                donor_values,
                positions,
                deviation[FIRST_STAGE_LAYER],
                check,
                ratio,
            )
            tokens, _ = model.greedy(keys, values, last, GREEDY_TOKENS)
            results.append(
                (f"staged@{check}", ratio, greedy_agreement(tokens, answer, GREEDY_TOKENS))
            )
    return margins, results


@click.command("blend-sim")
@click.option("--workloads", default="rag,rag_corpus", show_default=True)
@click.option("--lengths", default="2048", show_default=True)
@click.option("--groups", default=2, show_default=True, type=click.IntRange(1, 200))
@click.option(
    "--only",
    default="",
    help="comma-separated group indices (0-based) of the GROUPS built to simulate; default all",
)
@click.option("--ratios", default="0.15,0.3,0.5,0.7,0.9", show_default=True)
@click.option("--check-layers", default="1", show_default=True)
@click.option(
    "--selections",
    default=",".join(SELECTIONS),
    show_default=True,
    help="comma-separated selections to run (module doc)",
)
@click.option("--model-path", type=click.Path(path_type=Path), default=None)
def command(
    workloads: str,
    lengths: str,
    groups: int,
    only: str,
    ratios: str,
    check_layers: str,
    selections: str,
    model_path: Path | None,
) -> None:
    """Offline recompute simulation (no server): per probe of the built-in WORKLOADS, the
    32-token greedy agreement with cold of each selection of SELECTIONS (the module doc) at
    each ratio; markdown rows on stdout."""
    from ..cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    from transformers import AutoTokenizer

    from semblend_sglang.data import essay_texts
    from semblend_sglang.model_prep import prepare_model

    from .builtin_workloads import build_workload
    from .e2e import parse_lengths

    contexts = parse_lengths(lengths)
    names = parse_workloads(workloads)
    wanted = parse_ratios(ratios)
    chosen = parse_group_indices(only, groups)
    kinds = parse_selections(selections)
    parse_check_layers(check_layers)
    path = model_path or Path(prepare_model())
    model = LlamaReference(path)
    layers = parse_check_layers(check_layers, model.layers)
    tok = AutoTokenizer.from_pretrained(path)
    click.echo(
        "| workload | ctx | group | cold margins (first 3) | selection | "
        + " | ".join(f"{r:.0%}" for r in wanted)
        + " |"
    )
    click.echo("|" + "---|" * (5 + len(wanted)))
    for name in names:
        for length in contexts:
            built = build_workload(name, tok, essay_texts(), length, groups, 0)
            for index, group in enumerate(built.groups):
                if chosen and index not in chosen:
                    continue
                probe = group.probes[0].prompt_ids
                donors = [d.prompt_ids for d in group.donors]
                margins, results = simulate_group(
                    model, probe, donors, group.shared_spans, wanted, layers, kinds
                )
                shown = " ".join(f"{m:.3f}" for m in margins[:3])
                for selection in dict.fromkeys(s for s, _, _ in results):
                    cells = [f"{a:.2f}" for s, _, a in results if s == selection]
                    click.echo(
                        f"| {name} | {length} | {group.group_id} | {shown} | {selection} | "
                        + " | ".join(cells)
                        + " |"
                    )
