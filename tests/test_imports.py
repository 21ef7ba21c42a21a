"""The package's shape: no import cycle (function-local imports count), short files, __all__."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 400


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root`` (a package is its
    ``__init__.py``)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_graph(root: Path, top: str) -> dict[str, set[str]]:
    """Module -> the modules of package ``top`` it imports anywhere in its body (functions
    included). ``from pkg import name`` points at ``pkg.name`` when that is a module, else at
    ``pkg``; an import of an unknown dotted name points at its longest known prefix."""
    modules = module_files(root)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                if target == top or target.startswith(top + "."):
                    resolved = known(target)
                    if resolved is not None:
                        graph[name].add(resolved)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with a cycle (Tarjan), each as a set of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_counts_function_local_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.b import B\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n    return b\n")
    (pkg / "sub" / "b.py").write_text("from .. import a\nB = 1\n")
    (pkg / "c.py").write_text("import pkg.sub.b\nimport numpy\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"pkg": set(), "pkg.sub": {"pkg.sub.b"}, "pkg.a": {"pkg.sub.b"},
                     "pkg.sub.b": {"pkg.a"}, "pkg.c": {"pkg.sub.b"}}
    assert cycles(graph) == [{"pkg.a", "pkg.sub.b"}]


def test_no_import_cycle():
    assert cycles(import_graph(SRC, "distbelief")) == []


def test_no_source_file_over_400_lines():
    long = {str(path.relative_to(SRC)): n for path in module_files(SRC / "distbelief").values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_package_declares_all_and_exports_what_it_names():
    packages = [name for name, path in module_files(SRC).items() if path.name == "__init__.py"]
    assert "distbelief.sparse" in packages
    for name in packages:
        module = importlib.import_module(name)
        assert isinstance(getattr(module, "__all__", None), list), name
        assert [n for n in module.__all__ if not hasattr(module, n)] == [], name


def test_top_level_exports_every_trainer_the_embedding_and_config_types():
    import distbelief

    assert {"DownpourSGD", "SandblasterLBFGS", "SparseDownpourSGD", "SparseEmbedding",
            "TrainConfig", "TrainResult"} <= set(distbelief.__all__)
