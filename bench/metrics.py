"""Latency and quality metrics of the end-to-end bench: pure functions, no server.

Latency: :func:`percentile`, :func:`summarize_ms`, :func:`miss_overhead`. Quality against a cold
prefill of the same prompt: :func:`ppl_ratio` of a reference continuation teacher-forced through
the server (:func:`input_logprobs_from_meta` reads SGLang's answer), :func:`greedy_agreement` /
:func:`first_divergence` of greedy outputs and the cold :func:`divergence_margin` there,
:func:`rouge_l` / :func:`rouge_l_ids`; SGLang's KL measure of an answer's own logprobs against a
full-prefill replay of it: :func:`kl_divergence`. Against gold answers (the QA workloads):
:func:`score_answer` (:func:`yes_no` accuracy; SQuAD :func:`exact_match` and :func:`token_f1` of
spans); against the cold run's answer: :func:`read_answer`; paired right/wrong counts:
:func:`mcnemar_exact`.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .workloads import ANSWER_KINDS


def _finite_or_inf(values: Sequence[float], what: str) -> list[float]:
    out = [float(v) for v in values]
    if not out:
        raise ValueError(f"{what}: no values")
    if any(math.isnan(v) for v in out):
        raise ValueError(f"{what}: NaN in values")
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 <= q <= 100) with linear interpolation between the closest
    ranks, like ``numpy.percentile``'s default (``method="linear"``), except where infinities
    meet: ``inf`` there, where numpy's interpolation gives NaN.
    ValueError if ``values`` is empty or has a NaN, or ``q`` is out of range."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], not {q}")
    data = sorted(_finite_or_inf(values, "percentile"))
    pos = (len(data) - 1) * (q / 100)
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    frac = pos - lo
    if frac == 0 or data[hi] == data[lo]:
        return data[lo]
    return data[lo] + (data[hi] - data[lo]) * frac


def summarize_ms(values: Sequence[float]) -> dict[str, float | int]:
    """``{"p50", "p90", "mean", "min", "max", "n"}`` of latencies given in milliseconds (the
    result is in milliseconds too; multiply seconds by 1000 first). ValueError if empty."""
    data = _finite_or_inf(values, "summarize_ms")
    return {
        "p50": percentile(data, 50),
        "p90": percentile(data, 90),
        "mean": math.fsum(data) / len(data),
        "min": min(data),
        "max": max(data),
        "n": len(data),
    }


def miss_overhead(semblend: Sequence[float], vanilla: Sequence[float], q: float = 50) -> float:
    """Relative TTFT cost of a miss: ``percentile(semblend, q) / percentile(vanilla, q) - 1``
    (0.05 = 5% slower than vanilla SGLang on prompts with no donor)."""
    base = percentile(vanilla, q)
    if base <= 0:
        raise ValueError(f"vanilla percentile must be positive, not {base}")
    return percentile(semblend, q) / base - 1


def mean_or_none(values: Sequence[float]) -> float | None:
    """The mean of ``values``; None when there are none."""
    return sum(values) / len(values) if values else None


def fraction(part: float, whole: float) -> float | None:
    """``part / whole``, or None when ``whole`` is 0 (e.g. reused tokens over prompt tokens,
    hits over lookups, from the server's counters)."""
    return None if whole == 0 else part / whole


def perplexity(logprobs: Sequence[float]) -> float:
    """``exp(-mean(logprobs))`` of natural-log token probabilities. ValueError if empty or NaN;
    a ``-inf`` logprob gives ``inf``."""
    data = _finite_or_inf(logprobs, "perplexity")
    return math.exp(-math.fsum(data) / len(data))


def ppl_ratio(test_logprobs: Sequence[float], cold_logprobs: Sequence[float]) -> float:
    """``perplexity(test) / perplexity(cold)`` over the same reference tokens: 1.0 = the reused
    KV predicts the reference exactly as well as a cold prefill; > 1 = worse. Computed as
    ``exp(mean(cold) - mean(test))`` (no overflow for long references). ValueError if the two
    differ in length, are empty, or hold NaN."""
    test = _finite_or_inf(test_logprobs, "ppl_ratio test")
    cold = _finite_or_inf(cold_logprobs, "ppl_ratio cold")
    if len(test) != len(cold):
        raise ValueError(f"ppl_ratio: {len(test)} test logprobs vs {len(cold)} cold logprobs")
    return math.exp(math.fsum(cold) / len(cold) - math.fsum(test) / len(test))


def kl_terms(output_logprobs: Sequence[float], replay_logprobs: Sequence[float]) -> list[float]:
    """The per-token terms of SGLang's KL measure (``sglang.test.kl_test_utils``'s
    ``compare_kl_divergence``): ``exp(r) - 1 - r`` with ``r = replay - output`` at each token,
    where ``output_logprobs`` are the logprobs the server gave the tokens it generated and
    ``replay_logprobs`` those of the same tokens teacher-forced through a cold, full prefill of
    prompt + answer. Each term is >= 0; 0 where the two logprobs are equal. ValueError if the
    two differ in length, are empty, or hold NaN."""
    output = _finite_or_inf(output_logprobs, "kl_divergence output")
    replay = _finite_or_inf(replay_logprobs, "kl_divergence replay")
    if len(output) != len(replay):
        raise ValueError(f"kl_divergence: {len(output)} output vs {len(replay)} replay logprobs")
    return [math.expm1(r - o) - (r - o) for o, r in zip(output, replay, strict=True)]


def kl_divergence(output_logprobs: Sequence[float], replay_logprobs: Sequence[float]) -> float:
    """SGLang's KL measure of one answer (``compare_kl_divergence``, one sample): the mean of
    its :func:`kl_terms`. 0 = the answer's own distribution is the cold one at every token it
    took. ValueError as :func:`kl_terms`."""
    terms = kl_terms(output_logprobs, replay_logprobs)
    return math.fsum(terms) / len(terms)


def greedy_agreement(a_ids: Sequence[Hashable], b_ids: Sequence[Hashable], n: int = 32) -> float:
    """Fraction of the positions ``i < n`` where ``a[i] == b[i]``, over ``n`` positions.

    A position present in only one sequence is a disagreement (one output stopped earlier); a
    position missing from both counts as agreement (both stopped there, e.g. at EOS).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, not {n}")
    agree = 0
    for i in range(n):
        in_a, in_b = i < len(a_ids), i < len(b_ids)
        if (in_a and in_b and a_ids[i] == b_ids[i]) or (not in_a and not in_b):
            agree += 1
    return agree / n


def divergence_margin(
    answer: Sequence[Hashable],
    cold: Sequence[Hashable],
    cold_margins: Sequence[float],
    n: int = 32,
) -> float | None:
    """How close the cold run was to the token the answer took where they first differ: the
    cold run's top-1 / top-2 logprob margin at :func:`first_divergence` of the first ``n``
    positions. None when the first ``n`` agree, or the cold run has no token (or no margin)
    there."""
    at = first_divergence(answer[:n], cold[:n])
    if at is None or at >= len(cold) or at >= len(cold_margins):
        return None
    return float(cold_margins[at])


def first_divergence(a: Sequence[Hashable], b: Sequence[Hashable]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (a position present in only one
    counts, so ``[1, 2]`` vs ``[1, 2, 3]`` gives 2), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def rouge_l_ids(candidate: Sequence[Hashable], reference: Sequence[Hashable]) -> float:
    """ROUGE-L F1 (beta = 1) of two token sequences: with ``L`` = length of their longest common
    subsequence, ``P = L/len(candidate)``, ``R = L/len(reference)``, ``F = 2PR/(P+R)``. Two
    empty sequences score 1.0; one empty sequence, or ``L == 0``, scores 0.0. ``L`` is
    rapidfuzz's ``LCSseq.similarity`` (C++; imported here, so the modules that import this one
    without scoring ROUGE need no rapidfuzz)."""
    from rapidfuzz.distance import LCSseq

    if not candidate and not reference:
        return 1.0
    lcs = int(LCSseq.similarity(list(candidate), list(reference)))
    if lcs == 0:
        return 0.0
    p, r = lcs / len(candidate), lcs / len(reference)
    return 2 * p * r / (p + r)


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 of two texts over whitespace-separated tokens (``str.split()``; case and
    punctuation kept as they are)."""
    return rouge_l_ids(candidate.split(), reference.split())


def input_logprobs_from_meta(
    meta_info: Mapping[str, Any], n: int, expected_ids: Sequence[int] | None = None
) -> list[float]:
    """The last ``n`` prompt-token logprobs of an SGLang ``/generate`` answer's ``meta_info``.

    Format (sglang 0.5.23, ``TokenizerManager.add_logprob_to_meta_info`` /
    ``detokenize_logprob_tokens``): with ``"return_logprob": true`` and ``"logprob_start_len":
    s``, ``meta_info["input_token_logprobs"]`` is a list with one entry per prompt token from
    position ``s`` on, each ``[logprob, token_id, text]`` (a tuple, sent as a JSON list; ``text``
    is null unless ``"return_text_in_logprobs": true``). Entry ``k`` is log P(ids[s+k] |
    ids[:s+k]) (natural log); entry 0 is always null (the scheduler's
    ``SchedulerLogprobResultProcessor`` prepends None and drops the logit of the last token).

    To teacher-force a reference ``ref`` after a prompt ``p``: send ``input_ids = p + ref``,
    ``logprob_start_len = len(p) - 1``, ``max_new_tokens = 1``; the answer then has
    ``len(ref) + 1`` entries and the last ``len(ref)`` are the reference's logprobs. Note that
    SGLang caps a request's prefix match at ``logprob_start_len`` (``Req._compute_max_prefix_len``),
    so the prompt can still be served from cache but the reference is always computed.

    ``expected_ids``: if given, the token ids of those ``n`` entries must equal it (a check that
    the right tokens were scored). ValueError when the key is missing, there are fewer than
    ``n`` entries, one of the last ``n`` has no logprob, or the ids do not match.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, not {n}")
    entries = meta_info.get("input_token_logprobs")
    if entries is None:
        raise ValueError("meta_info has no 'input_token_logprobs' (send return_logprob=true)")
    if len(entries) < n:
        raise ValueError(f"{len(entries)} input logprobs, need {n}")
    tail = list(entries)[-n:]
    out: list[float] = []
    ids: list[int] = []
    for k, entry in enumerate(tail):
        if not isinstance(entry, Sequence) or len(entry) < 2:
            raise ValueError(
                f"input_token_logprobs[-{n - k}] is not [logprob, id, text]: {entry!r}"
            )
        if entry[0] is None:
            raise ValueError(f"input_token_logprobs[-{n - k}] has no logprob (null)")
        out.append(float(entry[0]))
        ids.append(int(entry[1]))
    if expected_ids is not None and list(expected_ids) != ids:
        raise ValueError(
            f"scored token ids {ids[:8]}... differ from the expected {list(expected_ids)[:8]}..."
        )
    return out


# --- question answering against gold answers (the QA workloads) ------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalization (its official ``evaluate-v1.1.py``): lowercase, drop ASCII
    punctuation, drop the articles ``a``/``an``/``the``, collapse whitespace."""
    text = "".join(c for c in text.lower() if c not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def answer_span(output: str) -> str:
    """The span answer read from a model's output: its first non-blank line (a chat model that
    goes on after a short answer starts a new line), stripped; empty when the output is blank."""
    for line in output.splitlines():
        if line.strip():
            return line.strip()
    return ""


def yes_no(output: str) -> str | None:
    """The first word ``yes`` or ``no`` in the normalized output (:func:`normalize_answer`), or
    None when it has neither."""
    for word in normalize_answer(output).split():
        if word in ("yes", "no"):
            return word
    return None


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the normalized ``prediction`` equals a normalized answer, else 0.0 (SQuAD EM,
    the maximum over ``answers``)."""
    mine = normalize_answer(prediction)
    return 1.0 if any(mine == normalize_answer(a) for a in answers) else 0.0


def token_f1(prediction: str, answers: Sequence[str]) -> float:
    """SQuAD token F1: the harmonic mean of precision and recall of the normalized
    ``prediction``'s words against a normalized answer's (word multisets), the maximum over
    ``answers``; 0.0 when nothing overlaps (or either side is empty)."""
    mine = normalize_answer(prediction).split()
    best = 0.0
    for answer in answers:
        gold = normalize_answer(answer).split()
        common = sum((Counter(mine) & Counter(gold)).values())
        if common == 0:
            continue
        precision, recall = common / len(mine), common / len(gold)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


@dataclass(frozen=True)
class QAScore:
    """One output scored against a gold answer: ``correct`` (yes/no: the answer read is the gold
    one; span: exact match; a summary is never counted right or wrong: 0.0), ``f1`` (span
    answers only; None otherwise) and ``rouge_l`` (summaries only: ROUGE-L F1 against the
    reference summary; None otherwise)."""

    correct: float
    f1: float | None
    rouge_l: float | None = None


def number_answer(output: str) -> float | None:
    """The number SGLang's GSM8K scorer reads from ``output`` (``get_answer_value`` of
    ``sglang.test.simple_eval_mixed_prefix_gsm8k``: the last number, commas removed), as a float
    (the scorer compares with ``==``, so 7 and 7.0 are one answer); None when it finds none. The
    scorer is imported on the first call (it imports sglang)."""
    from .mixed_prefix_math import sglang_mixed_prefix_eval

    scorer = sglang_mixed_prefix_eval()
    value = scorer.get_answer_value(output)
    return None if value == scorer.INVALID else float(value)


def score_answer(output: str, kind: str, answers: Sequence[str]) -> QAScore:
    """Score a model's ``output`` text against the gold ``answers`` of a ``kind`` question: for
    ``yes_no``, :func:`yes_no` of the output against ``answers[0]``; for ``span``,
    :func:`exact_match` and :func:`token_f1` of :func:`answer_span` of the output; for
    ``summary``, :func:`rouge_l` of the whole output against each reference (the maximum); for
    ``number``, :func:`number_answer` of the output against that of ``answers[0]``. The e2e
    summary calls it per QA record; ValueError for another ``kind``."""
    if kind == "yes_no":
        return QAScore(1.0 if yes_no(output) == answers[0] else 0.0, None)
    if kind == "span":
        span = answer_span(output)
        return QAScore(exact_match(span, answers), token_f1(span, answers))
    if kind == "summary":
        return QAScore(0.0, None, max(rouge_l(output, a) for a in answers))
    if kind == "number":
        read = number_answer(output)
        return QAScore(1.0 if read is not None and read == number_answer(answers[0]) else 0.0, None)
    raise ValueError(f"answer kind must be one of {ANSWER_KINDS}, not {kind!r}")


def read_answer(output: str, kind: str) -> str | None:
    """The answer a ``kind`` question's ``output`` gives, normalized, for comparing two runs'
    answers: for ``yes_no`` :func:`yes_no` of the output (None when it has neither word); for
    ``span`` :func:`normalize_answer` of :func:`answer_span`; for ``summary``
    :func:`normalize_answer` of the whole output; for ``number`` :func:`number_answer`.
    ValueError for another ``kind``."""
    if kind == "yes_no":
        return yes_no(output)
    if kind == "span":
        return normalize_answer(answer_span(output))
    if kind == "summary":
        return normalize_answer(output)
    if kind == "number":
        read = number_answer(output)
        return None if read is None else repr(read)
    raise ValueError(f"answer kind must be one of {ANSWER_KINDS}, not {kind!r}")


def mcnemar_exact(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value of paired right/wrong outcomes: ``b`` pairs right on the
    first side and wrong on the second, ``c`` the reverse. SciPy's exact binomial test
    (``scipy.stats.binomtest``, p = 0.5) of ``min(b, c)`` in ``b + c`` trials: twice the
    probability of at most ``min(b, c)``, capped at 1; 1.0 when ``b + c == 0`` (no discordant
    pair: no evidence). ValueError for a negative count."""
    if b < 0 or c < 0:
        raise ValueError(f"counts must be >= 0, not b={b}, c={c}")
    if b + c == 0:
        return 1.0
    from scipy.stats import binomtest  # imported here: the latency metrics need no SciPy

    return float(binomtest(min(b, c), b + c, 0.5).pvalue)
