"""``semblend-sglang doctor``: will semantic reuse run for these SGLang server flags, and why not.

The flags are parsed by SGLang's own parser and resolved by its own pipeline
(``ServerArgs.resolve_once``: the default attention backend per GPU, page-size constraints, model
overrides), on this machine or, with ``assume_gpu``, with SGLang's platform facts overridden
(``override_platform``) to those of the named GPU. The verdict comes from the checks the server
runs: :func:`.server_options.unsupported_options` (named at start-up) and
:func:`.backends.backend_reuse_reason` (the prefill backend). Reads only; starts
nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..attention.backends import backend_reuse_reason
from .server_options import unsupported_options

GPU_FACTS: dict[str, dict[str, Any]] = {
    "h100": {
        "is_cuda": True,
        "is_hip": False,
        "is_sm90": True,
        "is_sm100": False,
        "is_sm100_or_sm110": False,
        "is_sm120": False,
        "is_blackwell": False,
        "is_hopper_with_cuda_12_3": True,
        "has_flashinfer": True,
        "device_sm": 90,
        "device_capability": (9, 0),
    },
    "a100": {
        "is_cuda": True,
        "is_hip": False,
        "is_sm90": False,
        "is_sm100": False,
        "is_sm100_or_sm110": False,
        "is_sm120": False,
        "is_blackwell": False,
        "is_hopper_with_cuda_12_3": False,
        "has_flashinfer": True,
        "device_sm": 80,
        "device_capability": (8, 0),
    },
    "b200": {
        "is_cuda": True,
        "is_hip": False,
        "is_sm90": False,
        "is_sm100": True,
        "is_sm100_or_sm110": True,
        "is_sm120": False,
        "is_blackwell": True,
        "is_hopper_with_cuda_12_3": False,
        "has_flashinfer": True,
        "device_sm": 100,
        "device_capability": (10, 0),
    },
}
"""SGLang platform facts of each GPU ``--assume-gpu`` names (a CUDA 12.3+ install with
flashinfer, as SGLang's CUDA wheels bring)."""


class FlagError(ValueError):
    """SGLang's parser or resolution refused the flags (the message says why)."""


@dataclass(frozen=True)
class DoctorParams:
    """What to diagnose: SGLang server ``flags`` as given to ``launch_server``, and the GPU to
    assume (a key of :data:`GPU_FACTS`) or None for this machine."""

    flags: tuple[str, ...]
    assume_gpu: str | None = None


@dataclass(frozen=True)
class RoleVerdict:
    """One rank role's resolved attention ``backend`` and ``page_size``, and ``reasons`` reuse
    is off for it (empty: on). ``reuses``: whether semblend acts in this role at all (the
    decode role only reads KV the prefill wrote)."""

    role: str
    backend: str
    page_size: int
    reuses: bool
    reasons: tuple[str, ...] = field(default=())

    @property
    def line(self) -> str:
        """``<role>: reuse: on|off (<reasons>)  [backend X, page size N]``."""
        where = f"[backend {self.backend}, page size {self.page_size}]"
        if not self.reuses:
            return f"{self.role}: reads the prefill's KV as usual  {where}"
        state = "on" if not self.reasons else f"off ({'; '.join(self.reasons)})"
        return f"{self.role}: reuse: {state}  {where}"


@dataclass(frozen=True)
class DoctorReport:
    """The diagnosis: the ``machine`` it was resolved for, one verdict per rank role, and
    ``notes`` on what could not be checked."""

    machine: str
    roles: tuple[RoleVerdict, ...]
    notes: tuple[str, ...] = ()


@contextlib.contextmanager
def _platform(assume_gpu: str | None) -> Iterator[None]:
    if assume_gpu is None:
        yield
        return
    from sglang.srt.runtime_context import override_platform

    scope = override_platform(**GPU_FACTS[assume_gpu])
    scope.install()
    try:
        yield
    finally:
        scope.restore()


def _parse(flags: tuple[str, ...]) -> Any:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server", add_help=False)
    ServerArgs.add_cli_args(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            namespace = parser.parse_args(list(flags))
    except SystemExit as exc:
        said = err.getvalue().strip().splitlines()
        raise FlagError(said[-1] if said else f"unparsable flags (exit {exc.code})") from None
    return ServerArgs.from_cli_args(namespace)


def _model_config(server_args: Any) -> Any:
    """SGLang's ModelConfig of the served model, or None when it cannot be read here."""
    try:
        from sglang.srt.configs.model_config import ModelConfig

        return ModelConfig.from_server_args(server_args)
    except Exception:
        return None


def diagnose(params: DoctorParams) -> DoctorReport:
    """Resolve ``params.flags`` as SGLang would (for ``params.assume_gpu`` if named) and say, per
    rank role, whether semantic reuse runs. Raises :class:`FlagError` for flags SGLang's parser
    or resolution refuses, ValueError for an unknown GPU name."""
    if params.assume_gpu is not None and params.assume_gpu not in GPU_FACTS:
        raise ValueError(f"unknown GPU {params.assume_gpu!r}; known: {', '.join(GPU_FACTS)}")
    flags = params.flags
    if params.assume_gpu is not None and "--device" not in flags:
        flags = (*flags, "--device", "cuda")
    from sglang.srt.arg_groups.model_override_base import attention_backends_of, resolved_view

    with _platform(params.assume_gpu):
        server_args = _parse(flags)
        try:
            server_args.resolve_once()
        except Exception as exc:
            raise FlagError(f"SGLang refused the flags: {type(exc).__name__}: {exc}") from exc
        resolved = resolved_view(server_args)  # what the launch publishes
        prefill, decode = attention_backends_of(resolved)
        model_config = _model_config(server_args)
    page = int(getattr(resolved, "page_size", None) or 1)
    reasons = list(unsupported_options(resolved, model_config))
    backend_reason = backend_reuse_reason(str(prefill))
    if backend_reason is not None:
        reasons.append(backend_reason)
    notes = ()
    if model_config is None:
        notes = ("the model's config could not be read here: its RoPE and attention unchecked",)
    roles = (
        RoleVerdict("prefill", str(prefill), page, True, tuple(reasons)),
        RoleVerdict("decode", str(decode), page, False),
    )
    machine = params.assume_gpu or "this machine"
    return DoctorReport(machine, roles, notes)
