"""`scripts/bootstrap.sh legacy` is idempotent: with nothing changed, `make venv-legacy` installs
nothing. Skipped unless the installed sglang is a legacy version (`make test-legacy`)."""

from __future__ import annotations

import pytest

from tests.harness.versions import legacy_skip_reason

_SKIP = legacy_skip_reason()
if _SKIP is not None:
    pytest.skip(_SKIP, allow_module_level=True)

from test_bootstrap import assert_second_bootstrap_installs_nothing  # noqa: E402


def test_second_make_venv_legacy_installs_nothing() -> None:
    assert_second_bootstrap_installs_nothing(
        "venv-legacy", "VENV_LEGACY", ".semblend-bootstrap-legacy"
    )
