"""SGLang server options that semantic reuse does not support, named once at scheduler start.

Called by the adapters' ``Scheduler.__init__`` wrapper with the scheduler's resolved
``ServerArgs`` and ``ModelConfig``; reads only, imports nothing from sglang, never raises. Each
returned line names the option and why: the runtime then stays out of every request (no lookup,
no donor) instead of declining each one after a full lookup.
"""

from __future__ import annotations

from typing import Any

PLAIN_KV_DTYPES = frozenset({"auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32"})
"""``--kv-cache-dtype`` values whose pool stores K/V unquantized (what the kernels copy)."""


def unsupported_options(
    server_args: Any, model_config: Any = None, *, paged: bool = True
) -> list[str]:
    """One line per option of ``server_args`` (and ``model_config``) that rules reuse out:
    ``--disable-radix-cache`` (no exact cache holds donor KV), speculative decoding (the draft
    model's KV pool is never filled for reused spans), ``--page-size`` > 1 where the sglang
    version is not ``paged`` (:class:`.version_view.VersionView`), a quantized
    ``--kv-cache-dtype``, pipeline parallelism (the ranks agree on reuse only within an
    attention group), PD disaggregation (the prefill node would send reused KV to a decode node
    whose cache may insert it as exact), MLA or sliding-window attention, and a RoPE a delta
    rotation cannot correct (read from the engine's resolved model config:
    ``--json-model-override-args`` and ``--revision`` applied). Empty when every option is
    supported."""
    out: list[str] = []
    if getattr(server_args, "disable_radix_cache", False):
        out.append("--disable-radix-cache: no exact cache holds donor KV")
    spec = getattr(server_args, "speculative_algorithm", None)
    if spec is not None and str(spec).upper() not in ("NONE", ""):
        out.append(
            f"--speculative-algorithm {spec}: the draft model's KV is never filled for reused spans"
        )
    page = getattr(server_args, "page_size", None)
    if not paged and page is not None and int(page) > 1:
        out.append(f"--page-size {page}: this sglang version is served at page size 1 only")
    kv_dtype = str(getattr(server_args, "kv_cache_dtype", "auto") or "auto").lower()
    if kv_dtype not in PLAIN_KV_DTYPES:
        out.append(f"--kv-cache-dtype {kv_dtype}: a quantized KV pool is not copied")
    pp = getattr(server_args, "pp_size", 1)
    if pp is not None and int(pp) > 1:
        out.append(
            f"--pp-size {pp}: pipeline stages would copy their layers' KV without agreeing on it"
        )
    mode = str(getattr(server_args, "disaggregation_mode", "null") or "null")
    if mode != "null":
        out.append(
            f"--disaggregation-mode {mode}: reused KV would travel to a decode node whose cache "
            "may insert it as exact"
        )
    if model_config is not None:
        rope_error = model_rope_error(model_config)
        if rope_error is not None:
            out.append(f"RoPE of the served model: {rope_error}")
        arch = getattr(model_config, "attention_arch", None)
        if getattr(arch, "name", None) == "MLA":
            out.append("MLA attention: its compressed KV cache is not copied")
        if getattr(model_config, "is_hybrid_swa", False):
            out.append("sliding-window attention layers: their KV pool is not copied")
    return out


def engine_hf_config(model_config: Any) -> Any:
    """The HF config SGLang resolved for the served model (its text config for a multimodal
    one), or None."""
    return getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)


def model_rope_error(model_config: Any) -> str | None:
    """Why the served model's RoPE (from the engine's resolved config) is not supported, or None
    (supported, or no config to read)."""
    from semblend_sglang.kernels import RopeConfigError, RopeSpec

    hf = engine_hf_config(model_config)
    if hf is None:
        return None
    try:
        RopeSpec.from_hf_config(hf)
    except RopeConfigError as exc:
        return str(exc)
    return None
