"""semblend-sglang GPU runtime, loaded by every Python process whose PYTHONPATH holds this folder.

For a CUDA host that cannot load sglang's compiled extras (scripts/gpu/runtime; docs/gpu-kit.md):
this folder also holds the torch ``sgl_kernel`` stand-in and the ``IPython.display`` stub, found
by ordinary imports. This file installs the import-time fixes of :mod:`semblend_gpu_runtime` in
each process (sglang spawns its scheduler and detokenizer), then runs the ``sitecustomize`` this
one shadows, if the interpreter has one further down ``sys.path``.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _chain_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or spec.origin == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


from semblend_gpu_runtime import activate  # noqa: E402

activate()
_chain_next_sitecustomize()
