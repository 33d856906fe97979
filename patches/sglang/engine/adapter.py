"""The one interface between semblend and a family of SGLang versions.

``patch_radix_cache()`` picks the adapter whose :meth:`SglangAdapter.supports` accepts the installed
sglang version and calls :meth:`~SglangAdapter.apply`. An adapter is a table of wrappers of sglang
methods (:meth:`SglangAdapter.hook_table`) that call its :class:`~.request_flow.RequestFlow`, plus
the :class:`~.version_view.VersionView` the flow reads the version through. Everything
version-specific lives in the adapter's module; nothing outside ``semblend_sglang.patches.sglang``
touches sglang internals.

What the unified adapter (sglang 0.5.22+, :mod:`.unified`) wraps, what each wrapper calls and
when sglang calls it (every call on the scheduler's thread):

- UnifiedRadixCache.match_prefix -> RequestFlow.plan: a waiting request's prefix match.
- UnifiedRadixCache.checkpoint -> RequestFlow.publish_limit, published; DonorKV.watch_head: a
  request's KV published into the tree.
- UnifiedRadixCache.free_kv_row -> DonorKV.split_release, keep: a released request's slots freed.
- UnifiedRadixCache.on_release -> RequestFlow.release: a request leaves the tree.
- UnifiedRadixCache.finish -> RequestFlow.abort: a request ended unsuccessfully (aborted).
- UnifiedRadixCache.evictable_size, full_evictable_size -> DonorKV.held_tokens: the admission and
  eviction budgets.
- UnifiedRadixCache.evict, evict_for_alloc -> DonorKV.evict, forget_evicted: memory is needed.
- UnifiedRadixCache._free_values -> DonorKV.freed: the tree frees node values.
- UnifiedRadixCache.reset -> DonorKV.clear, forget_all: /flush_cache.
- PrefillAdder.add_one_req, add_chunked_req -> admission.admission_credit, admission_charge: a
  request admitted into a prefill batch.
- ScheduleBatch.prepare_for_extend -> RequestFlow.prepare_extend: a prefill batch laid out (the
  donor copy).
- ForwardBatch.init_new -> RequestFlow.forward_batch: its forward batch built (true positions, the
  check layer armed).
- PrefillCudaGraphRunner.can_run_graph, dp_attn._local_prefill_cuda_graph_vote ->
  hook_kit.graph_can_carry, batch_state.batch_reuse: a prefill step's CUDA-graph decision (and
  its DP vote).
- Scheduler.__init__ -> the start-up refusals, the runtime: scheduler start.
- Scheduler._add_request_to_queue -> substitute.substitute_request: a request's arrival (substitute
  mode only).
- SchedulerInternalStateController.get_internal_state -> the snapshot: /server_info,
  /semblend/snapshot.
- each backend's init_forward_metadata, forward_extend (.attention) -> the split view (.split_view):
  every forward; they act on batches holding a sparse request only.
- sglang.srt.kv_canary.single_forward_manager.manager.launch_endpoints_per_forward (a module
  function, wrapped at scheduler start only where sglang installed its KV canary:
  .kv_canary_record) -> CanaryRecorder.launch: each head and tail canary launch of a forward; it
  acts on batches holding a sparse request only.

**The raise rule.** A wrapper calls the original method, and the flow through
:meth:`~.request_flow.RequestFlow.guarded` (an error is counted, logged once, and the request
continues on the normal path), with two exceptions, both for a batch whose donor KV is copied
and whose lengths are shrunk already, so that no normal path is left for it: ``init_new``'s
:func:`.batch_state.forward_positions` raises ``ValueError`` when the batch's lengths and the
positions sglang computed disagree, and an attention path that cannot split such a batch raises
:class:`.hook_kit.SparseExtendUnsupported`; both stop the step rather than compute attention
at wrong positions (:func:`.backends.sparse_extend_supported` decides before any copy).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from semblend_sglang.config import Config

from ..attention import backends
from ..flow import batch_state
from ..wrapping import Originals, Wrappers, install_wrappers, restore

if TYPE_CHECKING:
    from ..flow.request_flow import RequestFlow
    from ..runtime import SemblendRuntime


@dataclass(frozen=True)
class HookTable:
    """What an adapter installs: ``wrappers`` by (class, method name), and whether the triton
    backend's sparse-extend hooks go with torch_native's (``triton_attention``)."""

    wrappers: Wrappers
    triton_attention: bool


class SglangAdapter(ABC):
    """Installs and removes semblend's hooks for one family of SGLang versions.

    ``apply`` is idempotent and leaves every original method recoverable; ``remove`` restores
    exactly what ``apply`` replaced. Neither may raise for a supported version.
    ``supported`` is the one declaration of the sglang versions the adapter serves.
    """

    name: str = "abstract"
    supported: ClassVar[SpecifierSet] = SpecifierSet("<0")
    """The sglang versions this adapter serves (pre-releases of them included)."""

    def __init__(self, config: Config, flow: RequestFlow) -> None:
        self.config = config
        self.flow = flow
        self._originals: Originals = {}
        self._own_attention_hooks = False

    @property
    def runtime(self) -> SemblendRuntime:
        """The per-process state (provider, donors, counters) of this adapter's flow."""
        return self.flow.runtime

    @classmethod
    def supports(cls, version: Version) -> bool:
        """True when this adapter serves sglang ``version`` (it is in :attr:`supported`)."""
        return cls.supported.contains(version, prereleases=True)

    @abstractmethod
    def hook_table(self) -> HookTable:
        """The wrappers of this version's sglang methods (built from the current originals;
        imports sglang)."""

    def apply(self) -> None:
        """Install the hook table and the attention hooks (idempotent). The attention hooks are
        removed with this adapter unless something else (the CPU plugin) installed them first."""
        if self._originals:
            return
        table = self.hook_table()
        self._originals = install_wrappers(table.wrappers)
        self._own_attention_hooks = not backends.hooks_installed("torch_native")
        backends.install_attention_hooks(triton=table.triton_attention)

    def remove(self) -> None:
        """Restore every method ``apply`` replaced (idempotent)."""
        restore(self._originals)
        self._originals.clear()
        if self._own_attention_hooks:
            backends.remove_attention_hooks()
            self._own_attention_hooks = False

    def is_applied(self) -> bool:
        """True while the hooks are installed."""
        return bool(self._originals)

    def extend_wrappers(self, schedule_batch: type, forward_batch: type) -> Wrappers:
        """Wrappers of ``ScheduleBatch.prepare_for_extend`` (the copy, after sglang laid the
        batch's rows out) and of the classmethod ``ForwardBatch.init_new`` (true positions, the
        check layer armed), the same in every version."""
        flow = self.flow
        orig_prepare = schedule_batch.prepare_for_extend
        orig_init_new = forward_batch.init_new  # bound to ForwardBatch (a classmethod)

        def prepare_for_extend(self: Any, *args: Any, **kwargs: Any) -> Any:
            batch_state.clear(self)
            out = orig_prepare(self, *args, **kwargs)
            flow.guarded("load", None, None, flow.prepare_extend, self)
            return out

        def init_new(cls: Any, batch: Any, model_runner: Any, *args: Any, **kwargs: Any) -> Any:
            ret = orig_init_new(batch, model_runner, *args, **kwargs)
            flow.forward_batch(batch, model_runner, ret)
            return ret

        return {
            (schedule_batch, "prepare_for_extend"): prepare_for_extend,
            (forward_batch, "init_new"): classmethod(init_new),
        }


def installed_sglang_version() -> Version | None:
    """The installed sglang's version, or None when sglang is absent or its version unparsable."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return Version(version("sglang"))
    except (PackageNotFoundError, InvalidVersion):
        return None
