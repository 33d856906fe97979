"""Which adapter serves which sglang version: each adapter's ``supported`` SpecifierSet, read by
``adapter_class_for`` (patch_radix_cache) and by the warning on a version none serves."""

from __future__ import annotations

import pytest
from packaging.version import Version

from semblend_sglang.patches.sglang import adapter_class_for, supported_versions
from semblend_sglang.patches.sglang.engine.legacy import LegacyRadixCacheAdapter
from semblend_sglang.patches.sglang.engine.unified import UnifiedRadixCacheAdapter


@pytest.mark.parametrize(
    ("version", "adapter"),
    [
        ("0.5.14", None),
        ("0.5.15", LegacyRadixCacheAdapter),
        ("0.5.15.post1", LegacyRadixCacheAdapter),
        ("0.5.18", LegacyRadixCacheAdapter),
        ("0.5.19", None),
        ("0.5.20", None),
        ("0.5.21", None),  # no checkpoint(): docs/sglang.md, "Version matrix"
        ("0.5.22", UnifiedRadixCacheAdapter),
        ("0.5.23", UnifiedRadixCacheAdapter),
        ("0.5.24.dev1", UnifiedRadixCacheAdapter),
        ("0.6.0", None),
    ],
)
def test_each_version_gets_the_adapter_whose_specifier_set_holds_it(
    version: str, adapter: type | None
) -> None:
    assert adapter_class_for(Version(version)) is adapter


def test_no_version_no_adapter_and_the_warning_names_every_set() -> None:
    assert adapter_class_for(None) is None
    text = supported_versions()
    for cls in (UnifiedRadixCacheAdapter, LegacyRadixCacheAdapter):
        assert str(cls.supported) in text and cls.name in text
