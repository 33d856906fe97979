"""``IPython.display`` stand-in: the ``HTML`` and ``display`` names sglang/utils.py imports.

sglang uses them in ``print_highlight`` for notebooks; outside a notebook IPython itself prints
an object's plain-text form, which is what :func:`display` does here.
"""

from __future__ import annotations

import sys
from typing import Any


class HTML:
    """An HTML fragment; ``str()`` and ``repr`` give the markup (IPython's plain-text form)."""

    def __init__(self, data: str | None = None) -> None:
        self.data = data or ""

    def __str__(self) -> str:
        return self.data

    def __repr__(self) -> str:
        return f"<IPython.display.HTML object: {self.data!r}>"


def display(*objs: Any, **_kwargs: Any) -> None:
    """Print each object's plain-text form on its own line to stdout, as IPython does outside a
    notebook (keyword options such as ``raw`` or ``display_id`` are accepted and ignored)."""
    for obj in objs:
        print(str(obj), file=sys.stdout)
