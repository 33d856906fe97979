"""Checks that hold for any weights, against real semblend servers (``bench any-weights``).

Random weights say nothing of answer quality, but three equalities hold whatever the weights, so
a run on random weights (the GPU kit's, docs/gpu-kit.md) can still prove the reuse path correct:

- ``recompute_all``: a semblend hit whose recompute selects every copied position
  (``deviation``, ratio 1, dense check) gives the first-token logprobs of the cold prefill of the
  same prompt;
- ``delta_zero``: a prompt whose reused spans all keep their positions (delta 0) and the context
  before them (the tail of an earlier request, held outside the exact cache because it reused
  KV) answers as that request answered, where an exact hit would have served the same KV;
- ``paths``: a sparse hit attended as its split view, and the same hit with the position mask,
  give the logprobs of its dense reference (every position computed, the kept ones forced to
  the donor's K/V); the counters show each path ran. A control shows the comparison can fail:
  the dense reference differs from cold by more than ten tolerances.

Each comparison is the largest absolute difference of the first generated token's logprobs over
:data:`PROBE_COUNT` fixed token ids (``token_ids_logprob``), so near-ties of random logits do not
decide it. Servers are started here (one per distinct settings of the roles of
:data:`ROLE_ENV`) or given by URL.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from ..server import http_json
from .client import flush_cache, semblend_snapshot

DONOR_HEAD = "Summarize the following essay in three sentences.\n\n"
TARGET_HEAD = "Read the essay below carefully and list the author's main arguments.\n\n"
TAIL = "\n\nIn one sentence, the essay argues that"
PROBE_COUNT = 32
"""Token ids whose first-token logprobs are compared (spread evenly over the vocabulary)."""
NEW_TOKENS = 4
CONTROL_FACTOR = 10.0
"""The dense reference must differ from cold by this many tolerances (the checks can fail)."""

_SPARSE = {
    "SEMBLEND_ENABLED": "1",
    "SEMBLEND_RECOMPUTE_STRATEGY": "deviation",
    "SEMBLEND_RECOMPUTE_RATIO": "0.3",
    "SEMBLEND_RECOMPUTE_CHECK_SHARE": "1",
    "SEMBLEND_RECOMPUTE_MIN_DEVIATION": "0",
    # no span's first tokens recomputed unless the selection picks them, so that a delta_zero
    # request (nothing selected) keeps its copy as copied; the paths' hit and its dense
    # reference make the same selection either way
    "SEMBLEND_SINK_TOKENS": "0",
}
_POSITION_MASK = {**_SPARSE, "SEMBLEND_SPARSE_PATH": "position_mask"}
ROLE_ENV: dict[str, dict[str, str]] = {
    # recompute_all's and delta_zero's requests carry their repair settings (RECOMPUTE_ALL,
    # DELTA_ZERO), so they share the position_mask role's server
    "recompute_all": _POSITION_MASK,
    "delta_zero": _POSITION_MASK,
    "split_view": {**_SPARSE, "SEMBLEND_SPARSE_PATH": "split_view"},
    "position_mask": _POSITION_MASK,
}
"""The semblend settings of each role's server; roles with the same settings share one server.
``split_view`` needs a backend with both paths (triton); torch_native (the CPU server) attends
every sparse batch with the position mask."""

RECOMPUTE_ALL: dict[str, Any] = {"recompute_ratio": 1.0}
"""The repair settings (``custom_params.semblend_reuse``) of the ``recompute_all`` check's hit:
its server's, at ratio 1."""

DELTA_ZERO: dict[str, Any] = {"recompute_strategy": "heads", "recompute_ratio": 0.0}
"""The repair settings of the ``delta_zero`` check's requests: no copied position recomputed
(with the server's ``sink_tokens`` 0, not even a span's first), so a copy is kept as copied."""


@dataclass(frozen=True)
class Prompts:
    """Token ids of the checks' requests: ``donor`` (head + passage), ``target`` (another head of
    another length + the passage + a tail: spans with a nonzero delta) and ``same_positions``
    (a head of the donor head's length whose first token differs, the passage, the tail: spans
    with delta 0)."""

    donor: list[int]
    target: list[int]
    same_positions: list[int]
    head_tokens: int


def build_prompts(tokenizer: Any, passage: str, passage_tokens: int) -> Prompts:
    """The checks' prompts over the first ``passage_tokens`` tokens of ``passage``; ValueError
    when the passage is shorter."""
    enc = lambda text: list(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    doc = enc(passage)[:passage_tokens]
    if len(doc) < passage_tokens:
        raise ValueError(f"passage has {len(doc)} tokens, fewer than {passage_tokens}")
    head, other, tail = enc(DONOR_HEAD), enc(TARGET_HEAD), enc(TAIL)
    same = (other + head)[: len(head)]
    if same[0] == head[0]:
        same[0] = head[1]
    return Prompts(head + doc, other + doc + tail, same + doc + tail, len(head))


@dataclass(frozen=True)
class Answer:
    """One greedy request's output ids, their logprobs, the first token's logprobs over the
    probe ids and the exact prefix hit SGLang reported (``cached_tokens``)."""

    ids: list[int]
    logprobs: list[float]
    probes: list[float]
    cached_tokens: int


def probe_ids(vocab_size: int) -> list[int]:
    """:data:`PROBE_COUNT` ids spread evenly over ``[0, vocab_size)`` (all of them when the
    vocabulary is smaller)."""
    step = max(1, vocab_size // PROBE_COUNT)
    return list(range(0, vocab_size, step))[:PROBE_COUNT]


def answer(
    url: str, ids: Sequence[int], probes: Sequence[int], *, salt: str | None = None, **custom: Any
) -> Answer:
    """A greedy ``/generate`` of :data:`NEW_TOKENS` tokens with logprobs (``custom``: its
    ``custom_params``; ``salt``: its ``cache_salt``, a namespace of its own)."""
    payload: dict[str, Any] = {
        "input_ids": list(ids),
        "sampling_params": {
            "max_new_tokens": NEW_TOKENS,
            "temperature": 0,
            "custom_params": custom,
        },
        "return_logprob": True,
        "token_ids_logprob": list(probes),
    }
    if salt is not None:
        payload["cache_salt"] = salt
    meta = http_json(url + "/generate", payload)["meta_info"]
    first = meta["output_token_ids_logprobs"][0]
    return Answer(
        ids=[int(e[1]) for e in meta["output_token_logprobs"]],
        logprobs=[float(e[0]) for e in meta["output_token_logprobs"]],
        probes=[float(e[0]) for e in first],
        cached_tokens=int(meta.get("cached_tokens", 0)),
    )


def gap(a: Answer, b: Answer) -> float:
    """Largest absolute difference of the two answers' first-token probe logprobs."""
    return max(abs(x - y) for x, y in zip(a.probes, b.probes, strict=True))


@dataclass
class CheckResult:
    """One check: its name, whether it passed, and what it measured."""

    name: str
    passed: bool
    detail: dict[str, Any] = field(default_factory=dict)


def _totals(url: str) -> dict[str, Any]:
    snap = semblend_snapshot(url)
    if snap is None:
        raise RuntimeError(f"{url} has no /semblend/snapshot route (not a semblend server)")
    return snap


def _delta(after: Mapping[str, Any], before: Mapping[str, Any], *path: str) -> float:
    a: Any = after
    b: Any = before
    for key in path:
        a, b = a.get(key, 0), b.get(key, 0)
    return float(a or 0) - float(b or 0)


def _after_donor(url: str, prompts: Prompts, probes: Sequence[int]) -> dict[str, Any]:
    flush_cache(url)
    answer(url, prompts.donor, probes)
    return _totals(url)


def check_recompute_all(
    url: str, prompts: Prompts, probes: Sequence[int], tol: float
) -> CheckResult:
    """On a ``recompute_all`` server: the hit, sent with :data:`RECOMPUTE_ALL`, recomputes
    every copied position and answers as cold."""
    before = _after_donor(url, prompts, probes)
    hit = answer(url, prompts.target, probes, semblend_reuse=RECOMPUTE_ALL)
    after = _totals(url)
    cold = answer(url, prompts.target, probes, salt=f"cold-{uuid.uuid4().hex}")
    detail = {
        "materialized": _delta(after, before, "outcomes", "materialized"),
        "kept_tokens": _delta(after, before, "reused_tokens"),
        "recomputed_tokens": _delta(after, before, "recomputed_tokens"),
        "gap_to_cold": gap(hit, cold),
        "tolerance": tol,
    }
    passed = (
        detail["materialized"] == 1
        and detail["kept_tokens"] == 0
        and detail["recomputed_tokens"] >= 0.9 * (len(prompts.donor) - prompts.head_tokens)
        and detail["gap_to_cold"] <= tol
    )
    return CheckResult("recompute_all", passed, detail)


def check_delta_zero(url: str, prompts: Prompts, probes: Sequence[int], tol: float) -> CheckResult:
    """On a ``delta_zero`` server, each request sent with :data:`DELTA_ZERO`: ``same_positions``
    reuses the donor's passage at delta 0; sent again, its exact hit ends before the passage
    (the first request published only its exact head) and its spans (delta 0, after the same
    context) copy the KV the first request held: it answers as the first request did."""
    before = _after_donor(url, prompts, probes)
    first = answer(url, prompts.same_positions, probes, semblend_reuse=DELTA_ZERO)
    middle = _totals(url)
    again = answer(url, prompts.same_positions, probes, semblend_reuse=DELTA_ZERO)
    after = _totals(url)
    detail = {
        "first_materialized": _delta(middle, before, "outcomes", "materialized"),
        "again_materialized": _delta(after, middle, "outcomes", "materialized"),
        "again_cached_tokens": again.cached_tokens,
        "head_tokens": prompts.head_tokens,
        "same_ids": again.ids == first.ids,
        "gap_to_first": gap(again, first),
        "tolerance": tol,
    }
    passed = (
        detail["first_materialized"] == 1
        and detail["again_materialized"] == 1
        and again.cached_tokens < len(prompts.same_positions) // 2
        and detail["same_ids"]
        and detail["gap_to_first"] <= tol
    )
    return CheckResult("delta_zero", passed, detail)


def check_paths(
    urls: Mapping[str, str], prompts: Prompts, probes: Sequence[int], tol: float
) -> CheckResult:
    """On each path's server (``split_view``, ``position_mask``): the sparse hit ran on that path
    and equals its dense reference; the paths equal each other; the dense reference differs
    from cold by more than :data:`CONTROL_FACTOR` tolerances."""
    sparse: dict[str, Answer] = {}
    detail: dict[str, Any] = {"tolerance": tol}
    passed = True
    for path, url in urls.items():
        before = _after_donor(url, prompts, probes)
        sparse[path] = answer(url, prompts.target, probes)
        after = _totals(url)
        ran = _delta(after, before, "sparse_extend_batches", path)
        materialized = _delta(after, before, "outcomes", "materialized")
        _after_donor(url, prompts, probes)
        dense = answer(url, prompts.target, probes, semblend_dense_reference=True)
        cold = answer(url, prompts.target, probes, salt=f"cold-{uuid.uuid4().hex}")
        detail[path] = {
            "materialized": materialized,
            "batches_on_path": ran,
            "gap_to_dense_reference": gap(sparse[path], dense),
            "control_gap_dense_to_cold": gap(dense, cold),
        }
        passed &= (
            materialized == 1
            and ran >= 1
            and detail[path]["gap_to_dense_reference"] <= tol
            and detail[path]["control_gap_dense_to_cold"] > CONTROL_FACTOR * tol
        )
    if len(sparse) == 2:
        a, b = sparse.values()
        detail["gap_between_paths"] = gap(a, b)
        passed &= detail["gap_between_paths"] <= tol
    return CheckResult("paths", passed and bool(sparse), detail)


def run_checks(
    urls: Mapping[str, str], prompts: Prompts, vocab_size: int, tol: float
) -> list[CheckResult]:
    """Every check whose servers ``urls`` (role -> URL) holds: ``recompute_all`` on its role,
    ``delta_zero`` on its role, ``paths`` over the path roles."""
    probes = probe_ids(vocab_size)
    results = []
    if "recompute_all" in urls:
        results.append(check_recompute_all(urls["recompute_all"], prompts, probes, tol))
    if "delta_zero" in urls:
        results.append(check_delta_zero(urls["delta_zero"], prompts, probes, tol))
    paths = {p: urls[p] for p in ("split_view", "position_mask") if p in urls}
    if paths:
        results.append(check_paths(paths, prompts, probes, tol))
    return results


@click.command("any-weights")
@click.option("--model-path", required=True, help="Model to serve and tokenize.")
@click.option(
    "--roles",
    default="recompute_all,delta_zero,split_view,position_mask",
    show_default=True,
    help=f"Server roles to start (of {', '.join(ROLE_ENV)}).",
)
@click.option("--passage-tokens", default=900, show_default=True, type=click.IntRange(300))
@click.option(
    "--tolerance",
    default=2e-3,
    show_default=True,
    type=float,
    help="Largest logprob difference taken as equal (float32: 2e-3; bf16: state yours).",
)
@click.option("--server-arg", "server_args", multiple=True, help="Extra sglang flag (repeat).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True)
def command(
    model_path: str,
    roles: str,
    passage_tokens: int,
    tolerance: float,
    server_args: tuple[str, ...],
    out_dir: Path,
) -> None:
    """Start one semblend server per distinct role settings (:data:`ROLE_ENV`), run the checks,
    write ``any-weights.json``; exit 1 when a check fails."""
    from ..cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    from transformers import AutoTokenizer

    from ..data import essay_texts
    from ..server import ServerSpec, start_healthy

    names = [r.strip() for r in roles.split(",") if r.strip()]
    unknown = [r for r in names if r not in ROLE_ENV]
    if unknown:
        raise click.BadParameter(f"unknown role(s) {unknown}", param_hint="'--roles'")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    passage = max(essay_texts(), key=len)
    prompts = build_prompts(tokenizer, passage, passage_tokens)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    shared: dict[str, list[str]] = {}  # one server per distinct role settings
    for role in names:
        shared.setdefault(json.dumps(ROLE_ENV[role], sort_keys=True), []).append(role)
    specs = [
        ServerSpec(
            model_path,
            extra_args=list(server_args),
            env=ROLE_ENV[roles_of[0]],
            log_path=out_dir / f"any-weights-{'+'.join(roles_of)}-server.log",
        )
        for roles_of in shared.values()
    ]
    servers = start_healthy(specs, timeout=600)
    try:
        click.echo(f"servers healthy after {time.monotonic() - started:.0f}s", err=True)
        urls = {
            r: srv.url for srv, group in zip(servers, shared.values(), strict=True) for r in group
        }
        results = run_checks(urls, prompts, len(tokenizer), tolerance)
    finally:
        for server in servers:
            server.stop()
    report = {"model": model_path, "roles": names, "results": [asdict(r) for r in results]}
    (out_dir / "any-weights.json").write_text(json.dumps(report, indent=1) + "\n")
    for r in results:
        click.echo(f"{'PASS' if r.passed else 'FAIL'} {r.name}: {json.dumps(r.detail)}")
    if not results or not all(r.passed for r in results):
        raise SystemExit(1)
