"""semblend-sglang: semantic KV-cache reuse for SGLang (and vLLM).

Finds an earlier request (the donor) whose KV is still resident, aligns its tokens with a new
request's tokens, and lets the engine reuse the donor's KV for the aligned span, RoPE-corrected,
while the engine's own exact prefix cache stays exact. See ARCHITECTURE in docs/.
"""

__version__ = "0.1.0"
