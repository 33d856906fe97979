"""The K/V copy is ordered after the engine's forward stream (patches/sglang/flow/span_copy.py).

With overlap scheduling on a GPU, SGLang prepares batch N+1 on its schedule stream while batch N's
forward still runs on the forward stream: that forward may still be writing a donor's KV (a chunk
the tree already holds) or reading slots freed and handed to batch N+1. The copy therefore waits
for the forward stream on the device. This machine has no CUDA device, so the stream objects here
are stand-ins (the test names say so); the scheduler hand-over runs the real wrapper.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from semblend_sglang.config import Config
from semblend_sglang.patches.sglang.engine.scheduler_hooks import wrap_scheduler_init
from semblend_sglang.patches.sglang.engine.unified import UnifiedRadixCacheAdapter
from semblend_sglang.patches.sglang.flow import span_copy
from semblend_sglang.patches.sglang.flow.request_flow import RequestFlow


class _Stream:
    """A stand-in CUDA stream that records what it waited for."""

    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait_stream(self, other: Any) -> None:
        self.waited.append(other)


def test_the_copy_waits_for_the_forward_stream_mock_cuda_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    current, forward = _Stream(), _Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    span_copy.wait_for_forward(forward, torch.device("cuda", 0))
    assert current.waited == [forward]
    span_copy.wait_for_forward(None, torch.device("cuda", 0))
    span_copy.wait_for_forward(current, torch.device("cuda", 0))  # already the current stream
    assert current.waited == [forward]


def _scheduler_class(server_args: Any, forward_stream: Any, flow: RequestFlow) -> type:
    """A stand-in scheduler class setting what sglang's ``Scheduler.__init__`` sets that the
    wrapper reads, with the real wrapper installed."""

    class Scheduler:
        def __init__(self) -> None:
            self.server_args = server_args
            self.model_config = None
            self.forward_stream = forward_stream

    Scheduler.__init__ = wrap_scheduler_init(Scheduler.__init__, flow)  # type: ignore[method-assign]
    return Scheduler


def test_the_scheduler_hands_its_forward_stream_to_the_flow_stand_in_scheduler(
    smollm2_model_dir: Path,
) -> None:
    from sglang.srt.server_args import ServerArgs

    forward = _Stream()
    for options, active in (({}, True), ({"kv_cache_dtype": "fp8_e4m3"}, False)):
        args = ServerArgs(model_path=str(smollm2_model_dir), device="cpu", **options)
        flow = UnifiedRadixCacheAdapter(Config()).flow
        runtime = flow.runtime
        _scheduler_class(args, forward, flow)()
        assert flow.engine.forward_stream is forward  # handed over, refused or not
        assert runtime.active is active
