"""Two-name stand-in for IPython on the GPU host (scripts/gpu/runtime): sglang/utils.py imports
``IPython.display.HTML`` and ``display`` at import time for a notebook helper only; the real
IPython set is 6.8 MiB of wheels the kit does not carry. Only ``IPython.display`` exists."""
