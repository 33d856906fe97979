"""Structure limits of the product code: module size and import cycles.

Reads the source as text (ast); imports nothing it checks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "semblend_sglang": ROOT / "semblend_sglang",
    "semblend_sglang.patches": ROOT / "patches",
    "semblend_sglang.kernels": ROOT / "kernels",
    "semblend_sglang.bench": ROOT / "bench",
}
"""Import name -> folder, as pyproject's package-dir maps them."""

MAX_PRODUCT_MODULE_LINES = 400
"""The limit of every module a server runs (semblend_sglang, patches, kernels)."""

MAX_BENCH_MODULE_LINES = 450
"""The limit in bench/, beside the product: the bench's jobs and their tables."""


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for prefix, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([prefix, *parts])
            if name.startswith("semblend_sglang.cpu_runtime.site"):
                continue  # stand-in packages (sgl_kernel, ...) installed as their own names
            found.setdefault(name, path)
    return found


def _top_level_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The product modules ``name`` imports when it is imported (module-level statements,
    outside ``if TYPE_CHECKING``), its own packages left out."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")
                    parent = parent[: len(parent) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)

    visit(tree.body)
    # a module's own packages are imported before it whatever it says: not an edge
    ancestors = {name.rsplit(".", i)[0] for i in range(name.count(".") + 1)}
    return {m for m in out if m in known and m not in ancestors}


def _limit(path: Path) -> int:
    bench = path.is_relative_to(ROOT / "bench")
    return MAX_BENCH_MODULE_LINES if bench else MAX_PRODUCT_MODULE_LINES


def test_no_product_module_is_over_the_line_limit() -> None:
    over = {
        str(path.relative_to(ROOT)): (n, _limit(path))
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > _limit(path)
    }
    assert not over, f"modules over their line limit (lines, limit): {over}"


def test_product_modules_import_no_cycle() -> None:
    modules = _modules()
    known = set(modules)
    graph = {name: _top_level_imports(name, path, known) for name, path in modules.items()}
    done: set[str] = set()
    stack: list[str] = []

    def walk(node: str) -> None:
        if node in stack:
            cycle = [*stack[stack.index(node) :], node]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if node in done:
            return
        stack.append(node)
        for dep in sorted(graph[node]):
            walk(dep)
        stack.pop()
        done.add(node)

    for name in sorted(graph):
        walk(name)
