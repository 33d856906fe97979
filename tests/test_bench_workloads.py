"""Built-in bench workloads (real essays, real SmolLM2 tokenizer) and the JSONL workload format.
The QA workloads (real questions, the chat template) are tests/test_bench_qa.py.

The tokenizer is the prepared model's own ``tokenizer.json`` loaded with ``tokenizers`` (the
library transformers wraps; same ids) so these tests do not pay for importing transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from semblend_sglang.bench import builtin_workloads as wl
from semblend_sglang.bench import essay_pool
from semblend_sglang.bench.builtin_workloads import (
    ESSAY_WORKLOADS,
    LENGTH_TOLERANCE,
    REFERENCE_TOKENS,
    build_workload,
)
from semblend_sglang.bench.workload_file import (
    WorkloadFileError,
    load_workload_file,
    write_workload_file,
)
from semblend_sglang.bench.workloads import BenchRequest, RequestGroup, Workload, prefix_order

LENGTHS = (512, 1024, 2048)
GROUPS = 3


@pytest.fixture(scope="module")
def tok(smollm2_model_dir: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(smollm2_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def essay_ids(tok: Any, essay_texts: list[str]) -> list[tuple[int, ...]]:
    return [tuple(e.ids) for e in tok.encode_batch(essay_texts, add_special_tokens=False)]


@pytest.fixture(scope="module")
def essay_keys(essay_ids: list[tuple[int, ...]]) -> list[str]:
    return [_key(ids) for ids in essay_ids]


@pytest.fixture(scope="module")
def built(tok: Any, essay_texts: list[str]) -> dict[tuple[str, int], Workload]:
    return {
        (name, ctx): build_workload(name, tok, essay_texts, ctx, GROUPS, seed=0)
        for name in ESSAY_WORKLOADS
        for ctx in LENGTHS
    }


CELLS = [(name, ctx) for name in ESSAY_WORKLOADS for ctx in LENGTHS]


def _key(ids: tuple[int, ...] | list[int]) -> str:
    return "," + ",".join(map(str, ids)) + ","


def contains(haystack: tuple[int, ...], needle: tuple[int, ...]) -> bool:
    """``needle`` occurs in ``haystack`` as a contiguous run."""
    return _key(needle) in _key(haystack)


def ngrams(ids: tuple[int, ...], n: int) -> set[tuple[int, ...]]:
    return {ids[i : i + n] for i in range(len(ids) - n + 1)}


def common_suffix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return common_prefix(a[::-1], b[::-1])


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def essay_of(span: tuple[int, ...], essay_keys: list[str]) -> int:
    """Index of the one essay that contains ``span``."""
    (index,) = [i for i, key in enumerate(essay_keys) if _key(span) in key]
    return index


def enc(tok: Any, text: str) -> tuple[int, ...]:
    return tuple(tok.encode(text, add_special_tokens=False).ids)


# --- built-in workloads ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ESSAY_WORKLOADS)
def test_deterministic_for_a_seed(name: str, tok: Any, essay_texts: list[str]) -> None:
    essay_pool._ESSAY_CACHE.clear()  # a cold tokenization cache must not change anything
    first = build_workload(name, tok, essay_texts, 512, GROUPS, seed=7)
    again = build_workload(name, tok, essay_texts, 512, GROUPS, seed=7)
    other = build_workload(name, tok, essay_texts, 512, GROUPS, seed=8)
    assert first == again
    assert first != other
    assert {r.prompt_ids for r in first.requests()} != {r.prompt_ids for r in other.requests()}


@pytest.mark.parametrize(("name", "ctx"), CELLS)
def test_shape_and_lengths(name: str, ctx: int, built: dict) -> None:
    w = built[name, ctx]
    assert w.name == name and w.context_tokens == ctx and len(w.groups) == GROUPS
    for group in w.groups:
        assert len(group.probes) == 1
        donors = {"control": 0, "rag_corpus": wl.RAG_CORPUS_DONORS}.get(name, 1)
        assert len(group.donors) == donors
        assert group.requests == group.donors + group.probes
        assert len(group.probes[0].prompt_ids) == ctx
        for donor in group.donors:
            if name == "multi_turn":  # one turn shorter than the probe
                assert ctx // 2 < len(donor.prompt_ids) < ctx - 16
            else:
                assert abs(len(donor.prompt_ids) - ctx) <= LENGTH_TOLERANCE
        for request in group.requests:
            assert len(request.reference_ids) == REFERENCE_TOKENS
            assert request.label


@pytest.mark.parametrize(("name", "ctx"), CELLS)
def test_shared_spans_are_in_every_request(name: str, ctx: int, built: dict) -> None:
    for group in built[name, ctx].groups:
        if name == "control":
            assert group.shared_spans == ()
            continue
        assert group.shared_spans
        reusable = sum(len(s) for s in group.shared_spans)
        assert reusable >= 0.75 * ctx, reusable
        if name == "rag_corpus":  # in the probe and in some donor: test_rag_corpus
            continue
        for span in group.shared_spans:
            for request in group.requests:
                assert contains(request.prompt_ids, span), (group.group_id, request.role)
        donor, probe = group.donors[0], group.probes[0]
        # Exact prefix caching alone cannot serve the probe: it differs before the content.
        assert common_prefix(donor.prompt_ids, probe.prompt_ids) < 48


@pytest.mark.parametrize(("name", "ctx"), CELLS)
def test_groups_share_no_content(name: str, ctx: int, built: dict) -> None:
    # Fixed pieces (a header line, a label, a question) repeat across groups; they are shorter
    # than 48 tokens. Control requests have no fixed piece at all: no shared 32-token run.
    n = 32 if name == "control" else 48
    seen: dict[tuple[int, ...], str] = {}
    for group in built[name, ctx].groups:
        mine = set().union(*(ngrams(r.prompt_ids + r.reference_ids, n) for r in group.requests))
        for gram in mine:
            assert seen.setdefault(gram, group.group_id) == group.group_id, (
                f"{group.group_id} shares a {n}-token run with {seen[gram]}"
            )


@pytest.mark.parametrize(("name", "ctx"), CELLS)
def test_reference_is_the_essay_text_after_the_context(
    name: str, ctx: int, built: dict, essay_ids: list[tuple[int, ...]], essay_keys: list[str]
) -> None:
    essays = essay_keys
    for request in built[name, ctx].requests():
        ref = _key(request.reference_ids)
        where = [(i, e.find(ref)) for i, e in enumerate(essays) if ref in e]
        assert where, "reference is not a run of any essay"
        i, at = where[0]
        position = essays[i][:at].count(",")  # token index of the reference in essay i
        assert position >= 32
        before = essay_ids[i][position - 32 : position]
        assert len(before) == 32 and contains(request.prompt_ids, before)
        if name in ("cross_instruction", "template", "control"):
            assert request.prompt_ids[-32:] == before  # the prompt ends where the text goes on


def passage_order(prompt: tuple[int, ...], passages: tuple[tuple[int, ...], ...]) -> list[int]:
    """Indices of ``passages`` in the order they appear in ``prompt``."""
    key = _key(prompt)
    return sorted(range(len(passages)), key=lambda j: key.find(_key(passages[j])))


def labels(text: str) -> int:
    """Role labels that open a turn in a plain-text conversation."""
    return sum(text.count(f"\n\n{label}") for label in wl.CHAT_ROLE_LABELS)


def test_cross_instruction(built: dict, tok: Any) -> None:
    heads = {enc(tok, text) for text in wl.INSTRUCTIONS}
    for group in built["cross_instruction", 1024].groups:
        donor, probe = group.donors[0], group.probes[0]
        (window,) = group.shared_spans
        assert donor.prompt_ids[-len(window) :] == window == probe.prompt_ids[-len(window) :]
        head_d = donor.prompt_ids[: -len(window)]
        head_p = probe.prompt_ids[: -len(window)]
        assert head_d in heads and head_p in heads and head_d != head_p


def test_rag(built: dict, tok: Any, essay_keys: list[str]) -> None:
    questions = [enc(tok, q) for q in wl.RAG_QUESTIONS]
    for group in built["rag", 1024].groups:
        donor, probe = group.donors[0], group.probes[0]
        passages = group.shared_spans
        assert len(passages) == wl.RAG_PASSAGES
        assert max(map(len, passages)) - min(map(len, passages)) <= 1  # ~equal slices
        assert passage_order(donor.prompt_ids, passages) == [0, 1, 2, 3]
        assert passage_order(probe.prompt_ids, passages)[0] != 0  # another first passage
        q_d = [q for q in questions if donor.prompt_ids[-len(q) :] == q]
        q_p = [q for q in questions if probe.prompt_ids[-len(q) :] == q]
        assert len(q_d) == len(q_p) == 1 and q_d != q_p  # the question goes last
        # The passages of one prompt come from different essays.
        assert len({essay_of(p, essay_keys) for p in passages}) == wl.RAG_PASSAGES


@pytest.mark.parametrize("ctx", LENGTHS)
def test_rag_corpus(built: dict, tok: Any, essay_keys: list[str], ctx: int) -> None:
    heads = [enc(tok, t) for t in wl.RAG_CORPUS_INSTRUCTIONS]
    for group in built["rag_corpus", ctx].groups:
        probe = group.probes[0]
        passages = group.shared_spans
        assert len(passages) == wl.RAG_PASSAGES
        for p in passages:  # every probe passage was retrieved by some earlier request
            assert _key(p) in _key(probe.prompt_ids)
            assert any(_key(p) in _key(d.prompt_ids) for d in group.donors)
        for d in group.donors:  # but no earlier request retrieved all of them
            assert not all(_key(p) in _key(d.prompt_ids) for p in passages)
        used = [h for r in group.requests for h in heads if _key(h) in _key(r.prompt_ids[:40])]
        assert len(used) == len(group.requests) == len(set(used))  # an instruction each
        assert len({essay_of(p, essay_keys) for p in passages}) == wl.RAG_PASSAGES


def test_prefix_order_puts_the_longest_donor_lead_first() -> None:
    assert prefix_order(["c", "a", "b", "d"], [["a", "b", "x", "c"]]) == ["a", "b", "c", "d"]
    # the donor whose leading passages are the longest run of probe passages wins
    donors = [["x", "a"], ["b", "d", "y"], ["d", "c", "a", "z"]]
    assert prefix_order(["a", "b", "c", "d"], donors) == ["d", "c", "a", "b"]
    assert prefix_order(["a", "b"], [["b", "b", "a"]]) == ["b", "a"]  # a passage once
    assert prefix_order(["a", "b"], []) == ["a", "b"]  # nothing to follow: the probe's order
    assert prefix_order(["a", "b"], [["b"], ["a"]]) == ["b", "a"]  # ties: the first donor


def test_rag_probes_reordered_for_an_exact_prefix(built: dict) -> None:
    """The reorder system's rewrite of a rag probe: its own tokens, passages in the donor's
    order, so the donor is an exact prefix up to the question; rag_corpus's probe keeps its own
    instruction, which no donor has, so its rewrite parts from every donor at once."""
    for group in built["rag", 1024].groups:
        donor, probe = group.donors[0], group.probes[0]
        assert sorted(probe.reordered_ids) == sorted(probe.prompt_ids)
        assert passage_order(probe.reordered_ids, group.shared_spans) == [0, 1, 2, 3]
        question = len(probe.prompt_ids) - common_suffix(probe.prompt_ids, probe.reordered_ids)
        assert common_prefix(probe.reordered_ids, donor.prompt_ids) >= question - 8
        assert common_prefix(probe.prompt_ids, donor.prompt_ids) < 16
    for group in built["rag_corpus", 1024].groups:
        probe = group.probes[0]
        assert sorted(probe.reordered_ids) == sorted(probe.prompt_ids)
        assert all(contains(probe.reordered_ids, p) for p in group.shared_spans)
        assert max(common_prefix(probe.reordered_ids, d.prompt_ids) for d in group.donors) < 16
    plain = [r for g in built["cross_instruction", 512].groups for r in g.requests]
    assert not any(r.reordered_ids for r in plain)


def test_template_changes_only_the_field(built: dict, tok: Any) -> None:
    changed = set()
    for ctx in LENGTHS:
        for group in built["template", ctx].groups:
            donor, probe = group.donors[0], group.probes[0]
            d_lines = tok.decode(list(donor.prompt_ids)).split("\n")
            p_lines = tok.decode(list(probe.prompt_ids)).split("\n")
            assert len(d_lines) == len(p_lines)
            diff = [(a, b) for a, b in zip(d_lines, p_lines, strict=True) if a != b]
            assert len(diff) == 1, diff
            (a, b) = diff[0]
            field = a.split(":")[0]
            assert field in ("Date", "User") and b.startswith(field + ": ")
            assert d_lines.index(a) <= 2  # near the start
            changed.add(field)
            # Token level: only the field's tokens differ.
            pre = common_prefix(donor.prompt_ids, probe.prompt_ids)
            suf = common_prefix(donor.prompt_ids[::-1], probe.prompt_ids[::-1])
            assert len(probe.prompt_ids) - pre - suf <= 8
    assert changed == {"Date", "User"}  # both kinds occur across the cells


def test_multi_turn(built: dict, tok: Any) -> None:
    for group in built["multi_turn", 1024].groups:
        donor, probe = group.donors[0], group.probes[0]
        d_text, p_text = tok.decode(list(donor.prompt_ids)), tok.decode(list(probe.prompt_ids))
        d_first, p_first = d_text.split("\n")[0], p_text.split("\n")[0]
        assert d_first != p_first and d_first.startswith("System:") and "date" in d_first
        assert labels(p_text) == labels(d_text) + 1 == wl.CHAT_TURNS + 1  # + the open label
        (conversation,) = group.shared_spans
        assert len(conversation) > 0.6 * len(probe.prompt_ids)
        assert d_text.endswith("Assistant:") and p_text.endswith("User:")


def test_control_is_all_misses(built: dict, essay_keys: list[str]) -> None:
    for ctx in LENGTHS:
        w = built["control", ctx]
        essays = [essay_of(g.requests[0].prompt_ids, essay_keys) for g in w.groups]
        assert len(set(essays)) == len(essays)  # one essay per request
        assert all(g.requests[0].role == "probe" for g in w.groups)


def test_invalid_arguments(tok: Any, essay_texts: list[str]) -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("nope", tok, essay_texts, 512, 1, 0)
    with pytest.raises(ValueError, match="context_tokens"):
        build_workload("rag", tok, essay_texts, 64, 1, 0)
    with pytest.raises(ValueError, match="groups"):
        build_workload("rag", tok, essay_texts, 512, 0, 0)
    with pytest.raises(ValueError, match="not enough essay text"):
        build_workload("control", tok, essay_texts[:3], 2048, 3, 0)


def test_data_model_contracts() -> None:
    with pytest.raises(ValueError, match="role"):
        BenchRequest((1,), "guest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        BenchRequest((), "probe")
    donor, probe = BenchRequest((1, 2), "donor"), BenchRequest((1, 3), "probe")
    with pytest.raises(ValueError, match="no probe"):
        RequestGroup("g", (donor,))
    with pytest.raises(ValueError, match="before"):
        RequestGroup("g", (probe, donor))
    group = RequestGroup("g", (donor, probe))
    with pytest.raises(ValueError, match="duplicate"):
        Workload("w", 2, (group, group))


# --- JSONL workload files -----------------------------------------------------------------


def _write(tmp_path: Path, lines: list[str], raw: bytes | None = None) -> Path:
    path = tmp_path / "user.jsonl"
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_valid_file(tmp_path: Path, tok: Any) -> None:
    path = _write(
        tmp_path,
        [
            "# a comment, then a blank line",
            "",
            json.dumps({"group": "a", "prompt": "Summarize this essay.", "label": "first"}),
            json.dumps({"group": "b", "input_ids": [5, 6, 7], "role": "probe"}),
            json.dumps({"group": "a", "prompt": "Summarise this essay.", "reference": " Done."}),
            "   # indented comment",
            json.dumps({"group": "a", "input_ids": [1, 2], "reference_ids": [3], "role": "probe"}),
        ],
    )
    w = load_workload_file(path, tok)
    assert w.name == "user"
    assert [g.group_id for g in w.groups] == ["a", "b"]
    a, b = w.groups
    assert [r.role for r in a.requests] == ["donor", "probe", "probe"]
    assert a.requests[0].prompt_ids == tuple(tok.encode("Summarize this essay.").ids)
    assert a.requests[0].label == "first"
    assert a.requests[1].reference_ids == enc(tok, " Done.")
    assert a.requests[2] == BenchRequest((1, 2), "probe", (3,))
    assert b.requests == (BenchRequest((5, 6, 7), "probe"),)  # a control group
    lengths = sorted(len(r.prompt_ids) for r in w.requests())
    assert w.context_tokens == round((lengths[1] + lengths[2]) / 2)
    assert load_workload_file(path, tok, name="mine").name == "mine"


def test_round_trip(tmp_path: Path, tok: Any, built: dict) -> None:
    original = built["rag", 512]
    first = tmp_path / "first.jsonl"
    write_workload_file(original, first)
    loaded = load_workload_file(first, None, name="rag")  # ids only: no tokenizer needed
    assert [g.group_id for g in loaded.groups] == [g.group_id for g in original.groups]
    assert [g.requests for g in loaded.groups] == [g.requests for g in original.groups]
    second = tmp_path / "second.jsonl"
    write_workload_file(loaded, second)
    assert load_workload_file(second, tok, name="rag") == loaded
    assert second.read_text() == first.read_text()


GOOD = json.dumps({"group": "g", "input_ids": [1, 2, 3]})
PROBE = json.dumps({"group": "g", "input_ids": [1, 2, 4]})


@pytest.mark.parametrize(
    ("lines", "line", "message"),
    [
        ([GOOD, '{"group": "g", "input_ids": [1, 2'], 2, "invalid JSON"),
        ([GOOD, PROBE, "[1, 2]"], 3, "expected a JSON object, got list"),
        ([GOOD, '"text"'], 2, "expected a JSON object, got str"),
        ([GOOD, '{"input_ids": [1]}'], 2, "missing 'group'"),
        (['{"group": 3, "input_ids": [1]}'], 1, "'group' must be a non-empty string"),
        (['{"group": "", "input_ids": [1]}'], 1, "'group' must be a non-empty string"),
        ([GOOD, '{"group": "g", "prompt": "x", "input_ids": [1]}'], 2, "exactly one of"),
        ([GOOD, '{"group": "g", "label": "x"}'], 2, "exactly one of"),
        ([GOOD, '{"group": "g", "prompt": ""}'], 2, "must not be empty"),
        ([GOOD, '{"group": "g", "prompt": 5}'], 2, "'prompt' must be a string"),
        ([GOOD, '{"group": "g", "input_ids": "1 2"}'], 2, "must be a list of token ids"),
        ([GOOD, '{"group": "g", "input_ids": [1, 2.5]}'], 2, "'input_ids'[1] must be an integer"),
        ([GOOD, '{"group": "g", "input_ids": [true]}'], 2, "must be an integer"),
        ([GOOD, '{"group": "g", "input_ids": []}'], 2, "must not be empty"),
        ([GOOD, '{"group": "g", "input_ids": [-1]}'], 2, "not a valid token id"),
        ([GOOD, '{"group": "g", "input_ids": [49152]}'], 2, "vocabulary size 49152"),
        ([GOOD, '{"group": "g", "input_ids": [1], "role": "guest"}'], 2, "unknown role"),
        ([GOOD, '{"group": "g", "input_ids": [1], "prio": 1}'], 2, "unknown key(s) 'prio'"),
        ([GOOD, '{"group": "g", "input_ids": [1], "label": 3}'], 2, "'label' must be a string"),
        ([GOOD, '{"group": "g", "input_ids": [1], "reference": [1]}'], 2, "'reference' must be"),
        (
            [GOOD, '{"group": "g", "input_ids": [1], "reference": "a", "reference_ids": [1]}'],
            2,
            "at most one of 'reference' and 'reference_ids'",
        ),
        ([GOOD, '{"group": "g", "input_ids": [1], "reference_ids": [1.0]}'], 2, "integer"),
        ([GOOD, '{"group": "g", "group": "h", "input_ids": [1]}'], 2, "duplicate key 'group'"),
        ([], 1, "no requests"),
        (["# only a comment", "", "  "], 3, "no requests"),
        ([GOOD, PROBE, json.dumps({"group": "h", "input_ids": [9]})], 3, "group 'h' has no probe"),
        (
            [GOOD, json.dumps({"group": "h", "input_ids": [9]}), PROBE],
            2,
            "group 'h' has no probe",
        ),
        (
            [GOOD, PROBE, json.dumps({"group": "g", "input_ids": [5], "role": "donor"})],
            3,
            "donor after a probe in group 'g' (probe on line 2)",
        ),
    ],
)
def test_file_errors(tmp_path: Path, tok: Any, lines: list[str], line: int, message: str) -> None:
    path = _write(tmp_path, lines)
    if not lines:
        path.write_text("")
    with pytest.raises(WorkloadFileError) as info:
        load_workload_file(path, tok)
    assert str(info.value).startswith(f"{path}:{line}: "), str(info.value)
    assert message in str(info.value)
    assert info.value.line == line and info.value.path == str(path)


def test_file_error_not_utf8(tmp_path: Path, tok: Any) -> None:
    path = _write(tmp_path, [], raw=(GOOD + "\n").encode() + b'{"group": "\xff"}\n')
    with pytest.raises(WorkloadFileError, match=r":2: not UTF-8"):
        load_workload_file(path, tok)


def test_file_error_text_needs_tokenizer(tmp_path: Path) -> None:
    path = _write(tmp_path, [GOOD, json.dumps({"group": "g", "prompt": "hello"})])
    with pytest.raises(WorkloadFileError, match=r":2: a text 'prompt' needs a tokenizer"):
        load_workload_file(path, None)


LONG = (4096, wl.fitting_length(8192, 8192, 32))


def test_a_long_prompt_stays_inside_the_model_context_with_its_answer() -> None:
    assert LONG[1] == 8192 - wl.LENGTH_TOLERANCE - max(32, REFERENCE_TOKENS) == 8112
    assert wl.fitting_length(1024, 8192, 32) == 1024
    assert wl.fitting_length(8192, 8192, 200) == 8192 - wl.LENGTH_TOLERANCE - 200


@pytest.mark.parametrize("ctx", LONG)
def test_long_prompts_of_every_workload_repeat_no_text_and_fit_the_context(
    tok: Any, essay_texts: list[str], ctx: int
) -> None:
    """At 4,096 and 8,112 tokens (the 8,192 window less the answer and the donors' slack),
    every built-in workload builds its prompts from the essays without any 64-token run
    occurring twice in one prompt, and no request leaves room for less than its reference."""
    for name in ESSAY_WORKLOADS:
        workload = build_workload(name, tok, essay_texts, ctx, 2, seed=1)
        for group in workload.groups:
            for request in group.requests:
                ids = request.prompt_ids
                runs = [ids[i : i + 64] for i in range(0, len(ids) - 63)]
                assert len(set(runs)) == len(runs), (name, ctx, request.label)
                assert len(ids) + REFERENCE_TOKENS <= 8192, (name, ctx, len(ids))
