"""DonorRouter (semblend_sglang.dispatch): donor-aware rank choice, load margin, namespaces,
byte bound, expiry and determinism, on the real index and chunking (no engine)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from semblend_sglang.config import Config
from semblend_sglang.dispatch import FIXED_BYTES, MAX_POSTINGS_PER_KEY, DonorRouter, Reason
from semblend_sglang.namespace import Namespace

NS = Namespace(model="m", tokenizer_fingerprint="t")
CONFIG = replace(Config(), dispatch_load_margin=1000)


def _doc(seed: int, n: int = 1000) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.int64)


def _with_head(seed: int, doc: np.ndarray, head: int = 40) -> np.ndarray:
    return np.concatenate((_doc(10_000 + seed, head), doc))


def test_a_probe_goes_to_the_rank_that_holds_its_donor() -> None:
    router = DonorRouter(CONFIG, 4)
    docs = [_doc(i) for i in range(4)]
    for rank, doc in enumerate(docs):
        router.record(NS, _with_head(rank, doc), rank)
    for rank, doc in enumerate(docs):
        route = router.choose(NS, _with_head(100 + rank, doc), [0, 0, 0, 0])
        assert (route.rank, route.reason) == (rank, Reason.DONOR)
        assert route.shared_tokens >= 0.8 * doc.size
    fresh = router.choose(NS, _doc(99), [0, 0, 0, 0])
    assert (fresh.rank, fresh.reason) == (None, Reason.NO_DONOR)


def test_the_rank_covering_most_of_the_request_wins() -> None:
    router = DonorRouter(CONFIG, 2)
    a, b = _doc(1, 600), _doc(2, 300)
    router.record(NS, a, 0)
    router.record(NS, np.concatenate((b, a[:100])), 1)
    route = router.choose(NS, np.concatenate((a, b)), [0, 0])
    assert route.rank == 0  # 600 shared tokens on rank 0 against ~400 on rank 1


def test_a_donor_rank_loaded_beyond_the_margin_is_skipped() -> None:
    router = DonorRouter(CONFIG, 2)
    doc = _doc(3)
    router.record(NS, doc, 1)
    probe = _with_head(7, doc)
    assert router.choose(NS, probe, [0, 1000]).rank == 1  # at the margin: still chosen
    skipped = router.choose(NS, probe, [0, 1001])
    assert (skipped.rank, skipped.reason) == (None, Reason.OVERLOADED)
    # the margin is relative to the least-loaded rank, not absolute
    assert router.choose(NS, probe, [5000, 5900]).rank == 1


def test_the_next_best_donor_on_an_unloaded_rank_is_taken_before_giving_up() -> None:
    router = DonorRouter(CONFIG, 3)
    doc = _doc(4)
    router.record(NS, doc, 1)
    router.record(NS, doc[:600], 2)
    probe = _with_head(8, doc)
    assert router.choose(NS, probe, [0, 0, 0]).rank == 1
    assert router.choose(NS, probe, [0, 5000, 0]).rank == 2


def test_inactive_ranks_are_never_proposed() -> None:
    router = DonorRouter(CONFIG, 2)
    doc = _doc(5)
    router.record(NS, doc, 1)
    route = router.choose(NS, _with_head(9, doc), [0, 0], active=[0])
    assert route.rank is None and route.reason == Reason.NO_DONOR


@pytest.mark.parametrize(
    "other",
    [
        replace(NS, cache_salt="tenant-b"),
        replace(NS, extra_key="k"),
        replace(NS, adapter="lora-1", extra_key="lora-1"),
        replace(NS, model="other-model"),
    ],
    ids=["cache_salt", "extra_key", "lora", "model"],
)
def test_namespaces_are_never_crossed(other: Namespace) -> None:
    router = DonorRouter(CONFIG, 2)
    doc = _doc(6)
    router.record(NS, doc, 1)
    assert router.choose(other, _with_head(1, doc), [0, 0]).reason == Reason.NO_DONOR
    assert router.choose(NS, _with_head(1, doc), [0, 0]).rank == 1


def test_the_index_stays_within_its_byte_bound() -> None:
    bound = 1024 * 1024
    router = DonorRouter(replace(CONFIG, dispatch_index_bytes=bound), 2)
    for i in range(1500):
        router.record(NS, _doc(i, 700), i % 2)
        assert router.charged_bytes() <= bound
    assert router.counts.get("evicted", 0) > 0
    assert router.nbytes() <= bound, router.nbytes()  # measured, not only charged
    # least recently recorded first out: the newest doc is found, the first is gone
    assert router.choose(NS, _doc(1499, 700), [0, 0]).rank == 1
    assert router.choose(NS, _doc(0, 700), [0, 0]).reason == Reason.NO_DONOR


def test_entries_expire_after_their_rank_was_sent_its_pool_size_in_tokens() -> None:
    router = DonorRouter(CONFIG, 2, rank_capacity_tokens=3000)
    doc = _doc(11)
    router.record(NS, doc, 0)
    for i in range(3):  # 3,000 other tokens to rank 1: rank 0's entry stays
        router.record(NS, _doc(200 + i), 1)
    assert router.choose(NS, _with_head(2, doc), [0, 0]).rank == 0
    for i in range(2):  # 2,000 to rank 0: not yet past its pool
        router.record(NS, _doc(300 + i), 0)
    assert router.choose(NS, _with_head(3, doc), [0, 0]).rank == 0
    router.record(NS, _doc(400), 0)  # 3,000 since (plus the probes' record = none)
    router.record(NS, _doc(401, 100), 0)
    expired = router.choose(NS, _with_head(4, doc), [0, 0])
    assert expired.reason == Reason.NO_DONOR and router.counts["expired"] == 1


def test_short_requests_are_neither_routed_nor_remembered() -> None:
    router = DonorRouter(CONFIG, 2)
    short = _doc(12, CONFIG.min_span_tokens - 1)
    router.record(NS, short, 1)
    assert len(router) == 0 and router.clock == [0, short.size]
    assert router.choose(NS, short, [0, 0]).reason == Reason.SHORT


def test_disabled_dispatch_proposes_nothing_and_remembers_nothing() -> None:
    router = DonorRouter(replace(CONFIG, dispatch_enabled=False), 2)
    doc = _doc(13)
    router.record(NS, doc, 1)
    assert len(router) == 0
    assert router.choose(NS, doc, [0, 0]).reason == Reason.DISABLED


def test_decisions_depend_only_on_the_calls() -> None:
    rng = np.random.default_rng(0)
    docs = [_doc(i, 500) for i in range(30)]
    calls = [
        (int(rng.integers(30)), int(rng.integers(1000)), rng.integers(0, 3000, 4))
        for _ in range(300)
    ]

    def run() -> list[tuple[int | None, str]]:
        router = DonorRouter(CONFIG, 4, rank_capacity_tokens=20_000)
        out = []
        for i, (d, head, loads) in enumerate(calls):
            tokens = _with_head(head, docs[d])
            route = router.choose(NS, tokens, loads.tolist())
            out.append((route.rank, route.reason))
            router.record(NS, tokens, route.rank if route.rank is not None else i % 4, route)
        return out

    first = run()
    assert first == run()
    assert {reason for _, reason in first} >= {Reason.DONOR, Reason.NO_DONOR, Reason.OVERLOADED}


def test_bad_input_raises_for_the_hook_to_fail_open() -> None:
    router = DonorRouter(CONFIG, 2)
    with pytest.raises(ValueError):
        router.record(NS, _doc(1), 2)
    with pytest.raises(ValueError):
        DonorRouter(CONFIG, 0)
    assert FIXED_BYTES < Config().dispatch_index_bytes


def test_a_chunk_shared_by_many_requests_points_to_the_newest_only() -> None:
    router = DonorRouter(CONFIG, 4)
    common = _doc(20, 400)  # a system prompt every request starts with
    for i in range(3 * MAX_POSTINGS_PER_KEY):
        router.record(NS, np.concatenate((common, _doc(500 + i, 600))), i % 4)
    newest = 3 * MAX_POSTINGS_PER_KEY - 1
    route = router.choose(NS, np.concatenate((common, _doc(999, 300))), [0, 0, 0, 0])
    assert route.rank == newest % 4  # ties on the common chunks: the newest request wins
    # one of the oldest requests, no longer posted under the common chunks, is still found by
    # its own content
    assert router.choose(NS, np.concatenate((common, _doc(501, 600))), [0, 0, 0, 0]).rank == 1


def test_the_router_chunks_coarser_than_the_provider_by_config() -> None:
    doc = _doc(21)
    for avg in (16, 64):
        router = DonorRouter(replace(CONFIG, dispatch_chunk_avg_tokens=avg), 2)
        assert router.params.avg == avg
        router.record(NS, doc, 1)
        assert router.choose(NS, _with_head(5, doc), [0, 0]).rank == 1
