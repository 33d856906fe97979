"""The cache-level test harness: real sglang KV-cache classes on CPU, driven like the scheduler.

* `kv_model`: the deterministic KV a cold prefill writes (`cold_kv`, the chain hash);
* `invariants`: the safety checker (`check_invariants`, `check_exact_match`, `assert_drained`);
* `driver`: the scheduler loop every version shares (`CacheHarness`, `HarnessConfig`);
* `unified` / `legacy`: the thin per-version parts (`SglangCacheHarness` for 0.5.23's
  `UnifiedRadixCache`, `LegacyCacheHarness` for 0.5.15's `RadixCache`);
* `hazard`: the deliberately wrong integration the checker must catch;
* `traffic`: real-text prompts and the randomized driver;
* `reuse`: checks of what semantic reuse loaded;
* `attention_backend`: sglang's real torch_native `forward_extend` on a random batch, and the
  dense reference;
* `random_models`: tiny random-weight HF model folders of each RoPE shape RopeSpec accepts
  (and one model class the recompute layer hook does not know), for the real server;
* `server`: the real SGLang server for end-to-end tests (`healthy_server`);
* `qa_records`: bench records of scored QA probes for the summary tests (`qa_record`);
* `versions`: which version is installed, and what the adapter-contract suite
  (tests/contract) needs to know about it.

Importing the package imports no sglang module (tests/vllm uses `kv_model` without sglang).
"""

from tests.harness.driver import CacheHarness, HarnessConfig, MatchHook, StepReport
from tests.harness.invariants import (
    InvariantViolation,
    TreeWalk,
    assert_drained,
    check_exact_match,
    check_invariants,
)
from tests.harness.kv_model import (
    NAMESPACE_NONE,
    chain_hash,
    chain_hashes,
    cold_kv,
    namespace_seed,
)
from tests.harness.legacy import LegacyCacheHarness
from tests.harness.traffic import (
    INSTRUCTIONS,
    NAMESPACES,
    document,
    drive_random,
    make_prompt,
    semantic_pair,
)
from tests.harness.unified import SglangCacheHarness

__all__ = [
    "INSTRUCTIONS",
    "NAMESPACES",
    "NAMESPACE_NONE",
    "CacheHarness",
    "HarnessConfig",
    "InvariantViolation",
    "LegacyCacheHarness",
    "MatchHook",
    "SglangCacheHarness",
    "StepReport",
    "TreeWalk",
    "assert_drained",
    "chain_hash",
    "chain_hashes",
    "check_exact_match",
    "check_invariants",
    "cold_kv",
    "document",
    "drive_random",
    "make_prompt",
    "namespace_seed",
    "semantic_pair",
]
