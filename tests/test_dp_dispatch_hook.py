"""The SGLang controller hook (patches/sglang/engine/dp_dispatch.py) on sglang 0.5.23's real
``DataParallelController`` dispatch methods, ``DPBudget``, ``TokenizedGenerateReqInput`` and
``sock_send`` over real zmq sockets, one PULL socket per rank.

The controller object is built with ``object.__new__`` and only the attributes the dispatch
methods read (its ``__init__`` launches scheduler processes); ``refresh_load_budget`` is replaced
by ``stub_refresh`` (the ranks' load snapshots need running schedulers).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from semblend_sglang.config import Config
from semblend_sglang.namespace import Namespace

pytest.importorskip("sglang")

N_RANKS = 2


@pytest.fixture(scope="module")
def dpc() -> Any:
    from sglang.srt.managers import data_parallel_controller

    return data_parallel_controller


_open: list[Any] = []
"""zmq contexts of this module's harnesses, destroyed after each test (an open context blocks
the interpreter's exit)."""


@pytest.fixture()
def installed(dpc: Any) -> Iterator[None]:
    from semblend_sglang.patches.sglang.engine.dp_dispatch import (
        install_dp_dispatch,
        uninstall_dp_dispatch,
    )

    assert install_dp_dispatch(Config())
    try:
        yield
    finally:
        uninstall_dp_dispatch()
        while _open:
            _open.pop().destroy(linger=0)
    assert not hasattr(dpc.sock_send, "__wrapped__")


class _Harness:
    def __init__(self, dpc: Any, method: str, config: Config) -> None:
        import zmq

        from semblend_sglang.patches.sglang.engine.dp_dispatch import DonorAwareDispatch

        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)
        _open.append(self.ctx)
        self.pull = []
        ctl = object.__new__(dpc.DataParallelController)
        ctl.workers = []
        for rank in range(N_RANKS):
            push = self.ctx.socket(zmq.PUSH)
            push.bind(f"inproc://rank{rank}-{id(self)}")
            pull = self.ctx.socket(zmq.PULL)
            pull.connect(f"inproc://rank{rank}-{id(self)}")
            ctl.workers.append(push)
            self.pull.append(pull)
        ctl.status = [True] * N_RANKS
        ctl._active_workers = list(range(N_RANKS))
        ctl.round_robin_counter = 0
        ctl.dp_budget = dpc.DPBudget(N_RANKS)
        ctl.load_balance_method = dpc.LoadBalanceMethod.from_str(method)
        ctl.max_total_num_tokens = 65536
        self.refreshes = 0

        def stub_refresh() -> None:
            self.refreshes += 1

        ctl.refresh_load_budget = stub_refresh
        original = {
            "round_robin": ctl.round_robin_scheduler,
            "total_tokens": ctl.total_tokens_scheduler,
        }[method]
        self.hook = DonorAwareDispatch(ctl, original, config, dpc.sock_send.__wrapped__)
        ctl.dispatching = self.hook
        self.ctl = ctl

    def send(self, ids: np.ndarray, **fields: Any) -> int:
        """Dispatch one request; returns the rank whose socket received it."""
        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput, sock_recv
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = TokenizedGenerateReqInput(
            input_text=None,
            input_ids=array("i", ids.tolist()),
            input_embeds=None,
            mm_inputs=None,
            token_type_ids=None,
            sampling_params=SamplingParams(max_new_tokens=1),
            return_logprob=False,
            logprob_start_len=-1,
            top_logprobs_num=0,
            token_ids_logprob=None,
            stream=False,
            **fields,
        )
        self.ctl.dispatching(req)
        got = []
        for rank, pull in enumerate(self.pull):
            if pull.poll(1000 if not got else 10):
                assert sock_recv(pull).input_ids == req.input_ids
                got.append(rank)
        assert len(got) == 1, got
        return got[0]


def _doc(seed: int, n: int = 800) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 40_000, n, dtype=np.int64)


def _head(seed: int) -> np.ndarray:
    return np.random.default_rng(1000 + seed).integers(0, 40_000, 30, dtype=np.int64)


@pytest.mark.usefixtures("installed")
def test_round_robin_controller_sends_the_probe_to_its_donors_rank(dpc: Any) -> None:
    h = _Harness(dpc, "round_robin", Config())
    doc = _doc(1)
    donor_rank = h.send(np.concatenate((_head(0), doc)))
    for i in range(1, 5):  # round-robin alone alternates; every probe follows the donor
        assert h.send(np.concatenate((_head(i), doc))) == donor_rank
    assert h.hook.stats()["donor"] == 4 and h.hook.errors == 0
    assert h.refreshes == 5  # the load view is refreshed before each choice
    # a request without a donor is SGLang's: round-robin continues where it was
    assert h.ctl.round_robin_counter == 1
    assert h.send(_doc(50)) == 1


@pytest.mark.usefixtures("installed")
def test_a_pinned_request_is_never_overridden_and_becomes_a_donor_there(dpc: Any) -> None:
    h = _Harness(dpc, "round_robin", Config())
    doc = _doc(2)
    assert h.send(np.concatenate((_head(0), doc)), routed_dp_rank=1) == 1
    assert h.send(np.concatenate((_head(1), doc)), routed_dp_rank=0) == 0  # pinned wins
    # both ranks now hold the document; unpinned probes go to one of them, never overridden pins
    assert h.send(np.concatenate((_head(2), doc)), routed_dp_rank=1) == 1
    assert h.hook.stats().get("donor", 0) == 0  # pinned requests are not even scored


@pytest.mark.usefixtures("installed")
def test_total_tokens_controller_skips_a_loaded_donor_rank(dpc: Any) -> None:
    h = _Harness(dpc, "total_tokens", replace(Config(), dispatch_load_margin=2000))
    doc = _doc(3)
    assert h.send(np.concatenate((_head(0), doc)), routed_dp_rank=1) == 1
    assert h.ctl.dp_budget.total_tokens == [0, 830]  # a pin counts at once (SGLang's does not)
    assert h.send(np.concatenate((_head(1), doc))) == 1  # within the margin: the donor wins
    h.ctl.dp_budget.total_tokens[:] = [0, 5000]
    assert h.send(np.concatenate((_head(2), doc))) == 0  # total_tokens decided
    assert h.hook.stats()["overloaded"] == 1
    assert h.ctl.dp_budget.total_tokens[0] == 830  # SGLang's own speculative count


@pytest.mark.usefixtures("installed")
def test_a_burst_pinned_to_the_donors_rank_is_seen_before_the_rank_reports_it(dpc: Any) -> None:
    h = _Harness(dpc, "round_robin", replace(Config(), dispatch_load_margin=2000))
    doc = _doc(5)
    assert h.send(np.concatenate((_head(0), doc)), routed_dp_rank=1) == 1
    for i in range(3):
        assert h.send(_doc(60 + i), routed_dp_rank=1) == 1
    assert h.send(np.concatenate((_head(1), doc))) == 0  # rank 1 carries 3,230 queued tokens
    assert h.hook.stats()["overloaded"] == 1


@pytest.mark.usefixtures("installed")
def test_namespaces_follow_the_schedulers_req(dpc: Any) -> None:
    from semblend_sglang.patches.sglang.engine.dp_dispatch import request_namespace

    h = _Harness(dpc, "round_robin", Config())
    doc = _doc(4)
    assert h.send(np.concatenate((_head(0), doc)), routed_dp_rank=1, cache_salt="a") == 1
    # another tenant's salt never follows the donor: round-robin places it (rank 0 first)
    assert h.send(np.concatenate((_head(1), doc)), cache_salt="b") == 0
    assert h.send(np.concatenate((_head(2), doc)), cache_salt="a") == 1
    assert h.hook.stats()["donor"] == 1
    ns = request_namespace(type("R", (), {"lora_id": "L", "extra_key": "k", "cache_salt": ""})())
    assert (ns.adapter, ns.extra_key, ns.cache_salt) == ("L", "kL", None)
    assert isinstance(ns, Namespace)


@pytest.mark.usefixtures("installed")
def test_an_error_in_semblends_part_falls_back_to_sglangs_method(dpc: Any) -> None:
    h = _Harness(dpc, "round_robin", Config())

    def broken(*_args: Any, **_kw: Any) -> Any:
        raise RuntimeError("boom")

    h.hook.router.choose = broken  # type: ignore[method-assign]
    h.hook.router.record = broken  # type: ignore[method-assign]
    assert [h.send(_doc(i)) for i in range(3)] == [0, 1, 0]
    assert h.hook.errors == 6


@pytest.mark.usefixtures("installed")
def test_a_cache_flush_makes_the_controller_forget_every_donor(dpc: Any) -> None:
    from sglang.srt.managers.io_struct import FlushCacheReqInput

    h = _Harness(dpc, "round_robin", Config())
    doc = _doc(7)
    donor_rank = h.send(np.concatenate([_head(1), doc]))
    assert h.send(np.concatenate([_head(2), doc])) == donor_rank  # routed to its donor
    sent: list[Any] = []
    flush = FlushCacheReqInput()
    h.hook.control(sent.append)(flush)
    assert sent == [flush] and len(h.hook.router) == 0 and h.hook.stats()["flushes"] == 1
    # the next probe has no donor left: SGLang's round-robin places it
    before = dict(h.hook.router.counts)
    h.send(np.concatenate([_head(3), doc]))
    after = h.hook.router.counts
    assert after["no_donor"] == before["no_donor"] + 1 and after["donor"] == before["donor"]
