"""Token index: shift-invariant chunks, ranking, LRU bound, compaction, memory per donor."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from semblend_sglang.chunk_keys import salted_keys, sketch_of, sketch_similarity
from semblend_sglang.chunking import (
    ChunkParams,
    as_token_array,
    chunk_tokens,
    kgram_hashes,
    token_hashes,
)
from semblend_sglang.index import TokenIndex
from semblend_sglang.namespace import Namespace

NS = Namespace("SmolLM2-135M-Instruct", "fp")
PARAMS = ChunkParams()


@pytest.fixture(scope="module")
def essay_ids(smollm2_tokenizer: Any, essay_texts: list[str]) -> np.ndarray:
    """Token ids of the 49 real essays, concatenated."""
    ids = [smollm2_tokenizer(t, add_special_tokens=False)["input_ids"] for t in essay_texts]
    return np.asarray([tok for part in ids for tok in part], dtype=np.int64)


@pytest.mark.parametrize("shift", [1, 5, 64, 999, 5000])
def test_same_text_at_another_offset_gives_the_same_chunks(
    essay_ids: np.ndarray, shift: int
) -> None:
    text = essay_ids[10000:14096]
    shifted = np.concatenate([essay_ids[60000 : 60000 + shift], text])
    a = chunk_tokens(text, PARAMS)
    b = chunk_tokens(shifted, PARAMS)
    # after the first content boundary inside `text`, chunks coincide exactly
    a_set = {(int(s), int(h)) for s, h in zip(a.starts[1:], a.hashes[1:], strict=True)}
    b_set = {(int(s) - shift, int(h)) for s, h in zip(b.starts, b.hashes, strict=True) if s > shift}
    assert len(a_set & b_set) >= len(a_set) - 1
    assert len(a) >= 4096 // PARAMS.max_size
    assert int(a.lengths.sum()) == text.size
    assert a.lengths.max() <= PARAMS.max_size


def test_chunk_hashes_depend_only_on_content(essay_ids: np.ndarray) -> None:
    text = essay_ids[20000:21000]
    first = chunk_tokens(text, PARAMS)
    again = chunk_tokens(as_token_array(text.tolist()), PARAMS)
    assert np.array_equal(first.hashes, again.hashes)
    edited = text.copy()
    edited[500] += 1
    changed = chunk_tokens(edited, PARAMS)
    assert not np.array_equal(first.hashes, changed.hashes)


def test_hashes_are_the_same_in_another_process(essay_ids: np.ndarray, tmp_path: Any) -> None:
    text = essay_ids[30000:34096]
    np.save(tmp_path / "t.npy", text)
    code = (
        "import sys, numpy as np;"
        "from semblend_sglang.chunking import ChunkParams, chunk_tokens;"
        f"c = chunk_tokens(np.load(r'{tmp_path / 't.npy'}'), ChunkParams());"
        "print(','.join(str(int(h)) for h in c.hashes))"
    )
    env = dict(os.environ, PYTHONHASHSEED="4242")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    mine = ",".join(str(int(h)) for h in chunk_tokens(text, PARAMS).hashes)
    assert out.stdout.strip() == mine


def test_kgram_hashes_match_direct_computation() -> None:
    tokens = np.asarray([5, 9, 5, 9, 5, 1, 2, 3, 5, 9, 5], dtype=np.int64)
    kh = kgram_hashes(token_hashes(tokens), 3)
    assert kh.size == tokens.size - 2
    for i in range(kh.size):
        for j in range(kh.size):
            same = tokens[i : i + 3].tolist() == tokens[j : j + 3].tolist()
            assert (kh[i] == kh[j]) == same


def test_probe_finds_the_donor_sharing_most_tokens(essay_ids: np.ndarray) -> None:
    index = TokenIndex(PARAMS, 100, keep_tokens=False)
    index.register(NS, "small-overlap", essay_ids[5000:9096])  # shares 1096 query tokens
    index.register(NS, "big-overlap", essay_ids[7500:11596])  # shares 3596
    index.register(NS, "unrelated", essay_ids[80000:84096])
    query = np.concatenate([essay_ids[90000:90030], essay_ids[8000:12066]])
    found = index.candidates(NS, chunk_tokens(query, PARAMS), limit=3, min_shared_tokens=64)
    assert [c.handle for c in found] == ["big-overlap", "small-overlap"]
    assert found[0].shared_tokens > found[1].shared_tokens
    assert 3000 <= found[0].shared_tokens <= 3596
    assert found[0].tokens is None  # the engine gives tokens back; the index keeps none
    other_ns = Namespace("SmolLM2-135M-Instruct", "other-fp")
    assert (
        index.candidates(other_ns, chunk_tokens(query, PARAMS), limit=3, min_shared_tokens=1) == []
    )


def test_lru_bound_holds_and_use_refreshes(essay_ids: np.ndarray) -> None:
    index = TokenIndex(PARAMS, 5, keep_tokens=True)
    evicted: list[Any] = []
    for h in range(12):
        evicted += index.register(NS, h, essay_ids[h * 1000 : h * 1000 + 600])
        assert len(index) <= 5
    assert evicted == list(range(7))
    assert index.handles() == [7, 8, 9, 10, 11]
    index.touch(7)
    assert index.register(NS, 12, essay_ids[12000:12600]) == [8]
    assert index.handles() == [9, 10, 11, 7, 12]
    query = chunk_tokens(essay_ids[8000:8600], PARAMS)  # donor 8's text: evicted
    assert all(c.handle != 8 for c in index.candidates(NS, query, limit=5, min_shared_tokens=1))
    index.register(NS, 9, essay_ids[30000:30600])  # re-registering a handle replaces it
    assert len(index) == 5 and index.handles()[-1] == 9


def test_byte_bound_drops_the_least_recently_used_donors(essay_ids: np.ndarray) -> None:
    """``max_bytes`` bounds what the live donors cost (postings, records, token copies); the
    charge agrees with the index's own measurement (``nbytes``) within the dead postings and
    container slack it leaves out."""
    probe = TokenIndex(PARAMS, 1000, keep_tokens=True)
    probe.register(NS, "one", essay_ids[:4096])
    one = probe.live_bytes
    assert one >= 4096 * 4 and abs(probe.nbytes() - one) < 0.5 * one
    index = TokenIndex(PARAMS, 1000, keep_tokens=True, max_bytes=int(4.5 * one))
    evicted: list[Any] = []
    for h in range(12):
        start = (h * 4099) % (essay_ids.size - 4096)
        evicted += index.register(NS, h, essay_ids[start : start + 4096])
        assert index.live_bytes <= index.max_bytes or len(index) == 1
    assert 3 <= len(index) <= 5
    assert evicted == list(range(12 - len(index)))  # oldest first
    assert index.handles() == list(range(12 - len(index), 12))
    assert index.nbytes() < 2 * index.max_bytes
    for h in index.handles():
        index.forget(h)
    assert index.live_bytes == 0


def test_forget_compaction_and_renumbering_keep_live_donors(essay_ids: np.ndarray) -> None:
    index = TokenIndex(PARAMS, 100000, keep_tokens=False)
    keep = {}
    for h in range(18000):
        start = (h * 37) % 150000
        index.register(NS, h, essay_ids[start : start + 96])
        if h % 1000 == 999:
            keep[h] = start
        else:
            index.forget(h)
    stats = index.stats()
    assert stats["donors"] == len(keep) == 18
    assert stats["next_id"] < 18000  # ids were renumbered
    assert stats["postings"] <= 2 * max(stats["live_postings"], 4096)  # dead postings dropped
    for h, start in keep.items():
        query = chunk_tokens(essay_ids[start : start + 96], PARAMS)
        found = index.candidates(NS, query, limit=30, min_shared_tokens=1)
        assert h in [c.handle for c in found]
        assert all(c.handle in keep for c in found)
    assert index.forget(12345) is False


def test_memory_per_donor_is_o_chunks(essay_ids: np.ndarray) -> None:
    index = TokenIndex(PARAMS, 1000, keep_tokens=False)
    donors = 300
    for h in range(donors):
        start = (h * 401) % (essay_ids.size - 4096)
        index.register(NS, h, essay_ids[start : start + 4096])
    per_donor = index.nbytes() / donors
    stats = index.stats()
    assert stats["live_postings"] / donors <= 4096 / PARAMS.min_size
    assert per_donor < 2048, per_donor  # hashes and a handle, not 16 KB of tokens
    copying = TokenIndex(PARAMS, 1000, keep_tokens=True)
    copying.register(NS, "x", essay_ids[:4096])
    assert copying.nbytes() >= 4096 * 4


def test_sketch_similarity_orders_overlap(essay_ids: np.ndarray) -> None:
    def sketch(tokens: np.ndarray) -> bytes:
        return sketch_of(np.unique(salted_keys(chunk_tokens(tokens, PARAMS), NS)))

    a = sketch(essay_ids[0:4096])
    assert sketch_similarity(a, a) == 1.0
    near = sketch_similarity(a, sketch(essay_ids[200:4296]))
    far = sketch_similarity(a, sketch(essay_ids[50000:54096]))
    assert near > far
    assert far <= 0.1


def test_probe_reads_only_the_newest_postings_of_a_hot_chunk(essay_ids: np.ndarray) -> None:
    """A document shared by more donors than the per-key cap: the probe sees only the newest
    postings of each chunk. Older donors hold more of the document, so without the cap they
    would rank first; with it, the newest donors are the ones found."""
    document = essay_ids[30000:32000]
    found: dict[int, list[int]] = {}
    for cap in (8, 1_000_000):
        index = TokenIndex(PARAMS, 1000, keep_tokens=True, max_postings_per_key=cap)
        for handle in range(40):
            head = essay_ids[50000 + 300 * handle : 50000 + 300 * handle + 200]
            body = document if handle < 32 else document[:1500]
            index.register(NS, handle, np.concatenate([head, body]))
        query = np.concatenate([essay_ids[90000:90200], document])
        cands = index.candidates(NS, chunk_tokens(query, PARAMS), limit=5, min_shared_tokens=64)
        found[cap] = [c.handle for c in cands]
    assert len(found[8]) == 5 and set(found[8]) <= set(range(32, 40)), found
    assert len(found[1_000_000]) == 5 and set(found[1_000_000]) <= set(range(32)), found
    with pytest.raises(ValueError, match="max_postings_per_key"):
        TokenIndex(PARAMS, 10, keep_tokens=True, max_postings_per_key=0)


def reference_candidates(
    donor_keys: list[np.ndarray],
    query: np.ndarray,
    *,
    limit: int,
    min_shared_tokens: int,
    cap: int,
) -> list[tuple[int, int]]:
    """The probe's documented semantics, spelled out over all donors (registered in list order,
    none forgotten): per query chunk, the newest ``cap`` donors holding its key each gain the
    chunk's tokens; donors with at least ``min_shared_tokens`` are ranked by tokens, then newest;
    ties at the cut are kept up to 4 x limit and ranked by (tokens, sketch similarity, newest).
    ``donor_keys``: each donor's sorted distinct posting keys. Returns (donor index, shared
    tokens) pairs."""
    key_sets = [set(k.tolist()) for k in donor_keys]
    chunks = chunk_tokens(query, PARAMS)
    score: dict[int, float] = {}
    for key, length in zip(salted_keys(chunks, NS).tolist(), chunks.lengths.tolist(), strict=True):
        holders = [i for i, keys in enumerate(key_sets) if key in keys]
        for i in holders[-cap:]:
            score[i] = score.get(i, 0.0) + length
    hits = sorted(
        ((s, i) for i, s in score.items() if s >= min_shared_tokens), key=lambda x: (-x[0], -x[1])
    )
    if not hits:
        return []
    cut_score = hits[min(limit, len(hits)) - 1][0]
    n_keep = max(limit, sum(1 for s, _ in hits if s >= cut_score))
    shortlist = hits[: min(n_keep, 4 * limit)]
    q_sketch = sketch_of(np.unique(salted_keys(chunks, NS)))
    ranked = sorted(
        shortlist,
        key=lambda x: (-x[0], -sketch_similarity(q_sketch, sketch_of(donor_keys[x[1]])), -x[1]),
    )
    return [(i, int(s)) for s, i in ranked[:limit]]


@pytest.mark.parametrize("cap", [2, 8, 64])
def test_probe_equals_its_definition_with_shared_documents(essay_ids: np.ndarray, cap: int) -> None:
    """Many donors share one document (so the large posting runs keep a directory of distinct
    keys), each behind its own head and cut at its own length; the probe, whichever grouping it
    uses (cap 2 reads few postings of many ids; 64 reads many), ranks like the definition."""
    document = essay_ids[60000:62400]
    donors = []
    for h in range(260):
        head = essay_ids[(h * 977) % 140000 : (h * 977) % 140000 + 40 + h % 50]
        body = document[(h * 37) % 400 : 1600 + (h * 53) % 800]
        donors.append(np.concatenate([head, body]))
    index = TokenIndex(PARAMS, 10_000, keep_tokens=False, max_postings_per_key=cap)
    for h, tokens in enumerate(donors):
        index.register(NS, h, tokens)
    donor_keys = [np.unique(salted_keys(chunk_tokens(d, PARAMS), NS)) for d in donors]
    assert any(run._distinct is not None for run in index._runs), "a run keeps a directory"
    queries = [
        np.concatenate([essay_ids[100000:100030], document[500:2100]]),
        np.concatenate([document[1200:2400], essay_ids[5000:5600]]),
        donors[17][::-1].copy(),  # chunks no donor has
        np.concatenate([donors[250][:300], donors[3][100:900]]),
    ]
    found = 0
    for query in queries:
        for limit, min_shared in ((3, 64), (1, 1), (5, 500)):
            got = index.candidates(
                NS, chunk_tokens(query, PARAMS), limit=limit, min_shared_tokens=min_shared
            )
            want = reference_candidates(
                donor_keys, query, limit=limit, min_shared_tokens=min_shared, cap=cap
            )
            found += bool(want)
            assert [(c.handle, c.shared_tokens) for c in got] == want
    assert found >= 6  # most probes find donors
