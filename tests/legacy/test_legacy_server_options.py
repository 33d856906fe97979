"""Server options the legacy adapter does not support are named once at scheduler start-up on
the real SGLang 0.5.15 CPU server (the same check as 0.5.23's, tests/test_e2e_server_options.py),
and the runtime then looks nothing up. Skipped unless the installed sglang is a legacy version
(`make test-legacy`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.harness.versions import legacy_skip_reason

_SKIP = legacy_skip_reason()
if _SKIP is not None:
    pytest.skip(_SKIP, allow_module_level=True)

from semblend_sglang.server import ServerSpec, http_json, start_healthy  # noqa: E402

pytestmark = pytest.mark.e2e


def test_legacy_server_names_a_disabled_radix_cache_at_start_and_looks_nothing_up(
    smollm2_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    smollm2_tokenizer: Any,
    essay_texts: list[str],
) -> None:
    log = tmp_path_factory.mktemp("legacy-no-radix") / "server.log"
    spec = ServerSpec(
        smollm2_model_dir,
        extra_args=["--disable-radix-cache"],
        env={"SEMBLEND_ENABLED": "1", "TRITON_INTERPRET": "0"},
        log_path=log,
    )
    (srv,) = start_healthy([spec], timeout=600)
    try:
        doc = smollm2_tokenizer.encode(essay_texts[0], add_special_tokens=False)[:600]
        for head in ("Summarize this essay.\n\n", "List the essay's main claims.\n\n"):
            ids = smollm2_tokenizer.encode(head, add_special_tokens=False) + doc
            payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4}}
            assert http_json(srv.url + "/generate", payload)["meta_info"]["completion_tokens"] == 4
        (rank,) = http_json(srv.url + "/semblend/snapshot")["ranks"]
        assert rank["lookups"] == 0 and rank["donors"] == 0, rank
        assert rank["unsupported_options"][0].startswith("--disable-radix-cache"), rank
        text = log.read_text(errors="replace")
        assert text.count("unsupported server options: --disable-radix-cache") == 1
        assert srv.alive()
    finally:
        srv.stop()
