"""Static scan of sglang's source for the names it imports at module import time on a CUDA host
(helper of tests/test_gpu_kit.py).

For each ``from X import a, b`` / ``import X`` whose module starts with a given prefix (e.g.
``sgl_kernel``) and that runs when its file is imported (not inside a function), the scan
records the ``if`` conditions around it and whether a ``try`` guards it. The conditions are
evaluated for a CUDA (NVIDIA Hopper) host by :func:`cuda_truth`: the platform probes sglang
uses (``is_cuda()``, ``_is_hip``, ``_use_aiter``, ...) have known values there; anything else
is *unknown*, so a test can fail on it instead of guessing.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TRUE_ON_CUDA = frozenset({"is_cuda", "is_cuda_alike", "_is_cuda", "_is_cuda_alike"})
"""Probe names (called or read) that are True on an NVIDIA GPU host."""

FALSE_ON_CUDA = frozenset(
    {
        "TYPE_CHECKING",
        "is_hip",
        "is_npu",
        "is_xpu",
        "is_musa",
        "is_cpu",
        "is_mps",
        "cpu_has_amx_support",
        "_is_hip",
        "_is_npu",
        "_is_xpu",
        "_is_musa",
        "_is_cpu",
        "_is_mps",
        "_is_cpu_amx_available",
        "_use_aiter",
    }
)
"""Probe names that are False there (ROCm, Ascend, Intel, Moore Threads, CPU, aiter, typing)."""


@dataclass(frozen=True)
class ImportSite:
    """One import statement that runs at module import time."""

    file: str
    lineno: int
    module: str
    names: tuple[str, ...]
    conditions: tuple[str, ...]
    guarded: bool

    def on_cuda(self) -> bool | None:
        """Whether it runs on a CUDA host: True, False, or None when a condition is unknown."""
        result: bool | None = True
        for condition in self.conditions:
            value = cuda_truth(ast.parse(condition, mode="eval").body)
            if value is False:
                return False
            if value is None:
                result = None
        return result


def _probe_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Call) and not node.args and not node.keywords:
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def cuda_truth(node: ast.expr) -> bool | None:
    """The value of an ``if`` test on a CUDA host, or None if it depends on anything but the
    known platform probes (``not``, ``and`` and ``or`` over them are evaluated)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = cuda_truth(node.operand)
        return None if inner is None else not inner
    if isinstance(node, ast.BoolOp):
        values = [cuda_truth(v) for v in node.values]
        if isinstance(node.op, ast.And):
            if False in values:
                return False
            return None if None in values else True
        if True in values:
            return True
        return None if None in values else False
    name = _probe_name(node)
    if name in TRUE_ON_CUDA:
        return True
    if name in FALSE_ON_CUDA:
        return False
    return None


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(
        _probe_name(n) in ("ImportError", "ModuleNotFoundError", "Exception", "BaseException")
        for n in names
    )


def import_sites(path: Path, prefix: str) -> Iterator[ImportSite]:
    """Every import-time import of a module named ``prefix`` or ``prefix.*`` in ``path``."""
    text = path.read_text(encoding="utf-8")
    if prefix not in text:  # most files: no need to parse
        return
    tree = ast.parse(text, filename=str(path))

    def matches(module: str) -> bool:
        return module == prefix or module.startswith(prefix + ".")

    def visit(body: list[ast.stmt], conditions: tuple[str, ...], guarded: bool) -> Iterator:
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0:
                if matches(stmt.module):
                    names = tuple(a.name for a in stmt.names)
                    yield ImportSite(
                        str(path), stmt.lineno, stmt.module, names, conditions, guarded
                    )
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if matches(alias.name):
                        yield ImportSite(
                            str(path), stmt.lineno, alias.name, (), conditions, guarded
                        )
            elif isinstance(stmt, ast.If):
                test = ast.unparse(stmt.test)
                yield from visit(stmt.body, (*conditions, test), guarded)
                yield from visit(stmt.orelse, (*conditions, f"not ({test})"), guarded)
            elif isinstance(stmt, ast.Try):
                catches = any(_catches_import_error(h) for h in stmt.handlers)
                yield from visit(stmt.body, conditions, guarded or catches)
                for handler in stmt.handlers:
                    yield from visit(handler.body, conditions, guarded)
                yield from visit(stmt.orelse + stmt.finalbody, conditions, guarded)
            elif isinstance(stmt, (ast.With, ast.For, ast.While, ast.ClassDef)):
                yield from visit(stmt.body, conditions, guarded)

    yield from visit(tree.body, (), False)


@dataclass
class CudaImports:
    """What a set of files imports from ``prefix`` on a CUDA host."""

    required: dict[str, set[str]]
    """module -> names imported unguarded (an ImportError there fails the import)."""
    optional: dict[str, set[str]]
    """module -> names imported under a try that catches ImportError."""
    unknown: list[ImportSite]
    """Sites whose conditions depend on something the scan cannot evaluate."""


def cuda_imports(files: list[Path], prefix: str) -> CudaImports:
    """Scan ``files`` for import-time imports of ``prefix`` that run on a CUDA host."""
    result = CudaImports({}, {}, [])
    for path in files:
        for site in import_sites(path, prefix):
            runs = site.on_cuda()
            if runs is None:
                result.unknown.append(site)
                continue
            if not runs:
                continue
            target = result.optional if site.guarded else result.required
            target.setdefault(site.module, set()).update(site.names)
    return result
