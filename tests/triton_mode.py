"""Which mode this process's Triton runs kernels in: compiled, or under its interpreter."""

from __future__ import annotations


def triton_interpreted() -> bool:
    """True when this process imported triton under ``TRITON_INTERPRET=1``, so its kernels run in
    the interpreter; False when they are compiled. ``triton.jit`` reads the flag when it is
    applied, triton.language's own helpers included, so the flag's value now says nothing: the
    test is whether ``triton.language.standard.zeros`` is an ``InterpretedFunction``. Imports
    triton (ImportError without it)."""
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.zeros, InterpretedFunction)
