"""Isolation key of a donor: model, tokenizer, adapter/LoRA, extra_key, cache_salt.

Two requests may share KV only when every field is equal; the provider never returns a donor from
another namespace. :func:`namespace_salt` is a 64-bit digest (blake2b, never Python ``hash()``), so
it is the same in every process and on every tensor-parallel rank.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any


@dataclass(frozen=True, slots=True)
class Namespace:
    """Isolation key; frozen and hashable. ``None`` and ``""`` are different values.

    ``model``: served model identity (path or name); ``tokenizer_fingerprint``: see
    :func:`tokenizer_fingerprint`; ``adapter``: LoRA/adapter id; ``extra_key`` and ``cache_salt``:
    the engine's own cache partition keys (SGLang ``RadixKey.extra_key``/``cache_salt``, vLLM
    ``cache_salt``).
    """

    model: str
    tokenizer_fingerprint: str | None = None
    adapter: str | None = None
    extra_key: str | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"Namespace.{f.name} must be str or None, got {type(value)!r}")
        if self.model is None:
            raise TypeError("Namespace.model must be a str")

    @property
    def salt(self) -> int:
        """64-bit digest of all fields (see :func:`namespace_salt`)."""
        return namespace_salt(self)


def _encode(ns: Namespace) -> bytes:
    parts: list[bytes] = []
    for f in fields(ns):
        value = getattr(ns, f.name)
        if value is None:
            parts.append(b"N")
        else:
            raw = value.encode("utf-8")
            parts.append(b"S" + len(raw).to_bytes(8, "little") + raw)
    return b"".join(parts)


@lru_cache(maxsize=4096)
def namespace_salt(ns: Namespace) -> int:
    """Deterministic 64-bit digest of ``ns`` (blake2b of a length-prefixed field encoding)."""
    return int.from_bytes(hashlib.blake2b(_encode(ns), digest_size=8).digest(), "little")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Deterministic fingerprint of a tokenizer: sha256 over its vocabulary and special tokens.

    Accepts a transformers tokenizer (``get_vocab()``, ``all_special_tokens``, ``all_special_ids``).
    Two tokenizers with the same vocabulary and special tokens get the same 32-hex-digit value in
    every process; any change to a token string, an id, or a special token changes it.
    """
    vocab = tokenizer.get_vocab()
    items = sorted((str(tok), int(idx)) for tok, idx in vocab.items())
    specials = sorted(
        zip(
            (str(t) for t in getattr(tokenizer, "all_special_tokens", ())),
            (int(i) for i in getattr(tokenizer, "all_special_ids", ())),
            strict=False,
        )
    )
    payload = json.dumps(
        {"vocab": items, "special": specials, "class": type(tokenizer).__name__},
        ensure_ascii=True,
        separators=(",", ":"),
    ).encode("ascii")
    return hashlib.sha256(payload).hexdigest()[:32]
