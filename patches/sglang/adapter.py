"""The one interface between semblend and a family of SGLang versions.

``patch_radix_cache()`` picks the adapter whose :meth:`SglangAdapter.supports` accepts the installed
sglang version and calls :meth:`~SglangAdapter.apply`. An adapter is a table of wrappers of sglang
methods (:meth:`SglangAdapter.hook_table`) that call its :class:`~.request_flow.RequestFlow`, plus
the :class:`~.version_view.VersionView` the flow reads the version through. Everything
version-specific lives in the adapter's module; nothing outside ``semblend_sglang.patches.sglang``
touches sglang internals.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from semblend_sglang.config import Config

from . import attention, one_pass
from .wrapping import Originals, Wrappers, install_wrappers, restore

if TYPE_CHECKING:
    from .request_flow import RequestFlow
    from .runtime import SemblendRuntime


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
        self._own_attention_hooks = not attention.hooks_installed("torch_native")
        attention.install_attention_hooks(triton=table.triton_attention)

    def remove(self) -> None:
        """Restore every method ``apply`` replaced (idempotent)."""
        restore(self._originals)
        self._originals.clear()
        if self._own_attention_hooks:
            attention.remove_attention_hooks()
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
            one_pass.clear(self)
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
