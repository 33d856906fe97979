"""SGLang 0.5.23's KV canary (``--kv-canary log|raise``) on the CPU engine.

The canary's kernels fall back to their torch references off CUDA, but three things around them
assume an accelerator, and each fails on a CPU-only torch:

- ``create_device_stream(cpu)`` calls ``torch.cpu.Stream(device=...)`` (TypeError: it takes no
  device) when the ``CanaryManager`` is built;
- its phase checker (``SimplePhaseChecker.update``) is a Triton kernel (no CPU driver);
- its device-to-host pump (``FutureTensors.device_to_host``) allocates ``pin_memory=True``.

:func:`apply_canary_cpu_shim` replaces each for CPU devices only (a stream made without the
device argument, the same phase state machine run on the host, an unpinned copy); any other
device goes to sglang's own code. Not covered: ``SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT``
(its token snapshot pins host memory and its scatter is another Triton kernel).
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from typing import Any

CANARY_MANAGER = "sglang.srt.kv_canary.runner.canary_manager"
"""The module that binds ``create_device_stream`` at import: the shim goes in before it runs."""
_MARK = "_semblend_cpu_shim"


def apply_canary_cpu_shim() -> bool:
    """Apply the three CPU stand-ins in this process (imports sglang's utils, phase checker and
    canary pump modules); True when this call applied them. Idempotent; no-op where
    ``sglang`` is not installed (False)."""
    try:
        from sglang.srt import utils
        from sglang.srt.kv_canary.runner import future_tensor
        from sglang.srt.utils import common, phase_checker
    except ImportError:
        return False
    if getattr(common.create_device_stream, _MARK, False):
        return False
    stream = _cpu_stream(common.create_device_stream)
    for module in (common, utils, sys.modules.get(CANARY_MANAGER)):
        if module is not None and hasattr(module, "create_device_stream"):
            module.create_device_stream = stream
    checker = phase_checker.SimplePhaseChecker
    checker.update = _host_phase_update(checker.update)  # type: ignore[method-assign]
    pump = future_tensor.FutureTensors
    pump.device_to_host = classmethod(_unpinned(pump.device_to_host.__func__))  # type: ignore[method-assign]
    return True


def _cpu_stream(original: Any) -> Any:
    def create_device_stream(device: Any) -> Any:
        import torch

        if torch.device(device).type == "cpu":
            return torch.cpu.Stream()
        return original(device)

    setattr(create_device_stream, _MARK, True)
    return create_device_stream


def _host_phase_update(original: Any) -> Any:
    def update(self: Any, *, expect_phase: Any, next_phase: Any, caller_name: str = "") -> None:
        if self._phase.device.type != "cpu":
            original(
                self, expect_phase=expect_phase, next_phase=next_phase, caller_name=caller_name
            )
            return
        current = int(self._phase)
        if int(self._enable_assert_device[0]) != 0 and current != int(expect_phase):
            raise AssertionError(
                f"SimplePhaseChecker: phase mismatch in {caller_name!r}: "
                f"expected {int(expect_phase)}, found {current}"
            )
        self._phase.fill_(int(next_phase))

    return update


def _unpinned(original: Any) -> Any:
    def device_to_host(cls: Any, xs_device: Any, *, d2h_stream: Any) -> Any:
        import torch

        values = xs_device.values() if isinstance(xs_device, dict) else (xs_device,)
        first = next((x for x in values if isinstance(x, torch.Tensor)), None)
        if first is None or first.device.type != "cpu":
            return original(cls, xs_device, d2h_stream=d2h_stream)
        if isinstance(xs_device, dict):
            data = {
                k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                for k, v in xs_device.items()
            }
        else:
            data = {"__dummy_key__": xs_device.detach().clone()}
        return cls(_data=data, _event=torch.cpu.Event(), _retained_device_clones=None)

    return device_to_host


class _CanaryImportHook(importlib.abc.MetaPathFinder):
    """Applies the shim just before :data:`CANARY_MANAGER` is first imported; finds nothing."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname == CANARY_MANAGER:
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
            try:
                apply_canary_cpu_shim()
            except Exception as exc:  # the canary then fails on CPU as sglang ships it
                logging.getLogger(__name__).warning("semblend: KV canary CPU shim: %r", exc)
        return None


def install_canary_cpu_hook() -> None:
    """Arrange for :func:`apply_canary_cpu_shim` to run before sglang builds a canary in this
    process (now, when sglang's canary module is imported already). Called by the CPU
    runtime's ``sitecustomize`` and :func:`~semblend_sglang.cpu_runtime.activate_in_process`;
    never where CUDA is available. Idempotent."""
    if CANARY_MANAGER in sys.modules:
        apply_canary_cpu_shim()
        return
    if not any(isinstance(f, _CanaryImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _CanaryImportHook())
