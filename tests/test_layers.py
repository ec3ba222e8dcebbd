"""The layering rules (DESIGN section 6b), read from the source with `ast`:

- no import cycle among the project's modules (`moemesh`, `kernels`, every `*_svc`, `deploy`);
- no service package (`*_svc`) imports another service package;
- nothing under `moemesh/` imports a service, except the command line (`moemesh/cli`) and the
  launcher (`moemesh/launcher`);
- `kernels/` imports nothing of the project but itself.

Every import counts, also one inside a function (a lazy import still ties the modules together).
`from a import b` is an import of module `a.b` when that module exists, else of `a`.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def project_packages() -> list[str]:
    return sorted(["moemesh", "kernels", "deploy", *(p.name for p in ROOT.glob("*_svc") if (p / "__init__.py").is_file())])


def module_files() -> dict[str, Path]:
    """module name -> file, for every module of the project's packages."""
    out = {}
    for pkg in project_packages():
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            if "_proto" in parts:  # generated stubs
                continue
            out[".".join(parts)] = path
    return out


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line})"


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` names (itself, or the closest enclosing module), None if outside."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports(module: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    edges = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                edges.append(Edge(module, target, node.lineno))
    return edges


def import_graph() -> list[Edge]:
    modules = module_files()
    return sorted({e for m, p in sorted(modules.items()) for e in imports(m, p, modules)}, key=lambda e: (e.source, e.line, e.target))


def top(module: str) -> str:
    return module.split(".")[0]


def is_service(module: str) -> bool:
    return top(module).endswith("_svc")


def cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:  # iterative would be longer; the graph is a few hundred modules deep at most
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def describe(edges: list[Edge]) -> str:
    return "\n".join(f"  {e}" for e in edges)


def test_the_walker_sees_the_project():
    modules = module_files()
    assert {"moemesh.config", "kernels.prepare", "control_svc.plane", "router_svc.router"} <= set(modules)
    edges = import_graph()
    assert any(e.source.startswith("moemesh.cli.") and top(e.target) == "moemesh" for e in edges)
    assert all(e.source != e.target for e in edges)


def test_the_walker_finds_cycles_and_relative_imports(tmp_path):
    modules = {"p": tmp_path / "p" / "__init__.py", "p.a": tmp_path / "p" / "a.py", "p.b": tmp_path / "p" / "b.py"}
    for path in modules.values():
        path.parent.mkdir(exist_ok=True)
    modules["p"].write_text("")
    modules["p.a"].write_text("from . import b\n")
    modules["p.b"].write_text("def f():\n    from p.a import thing\n")
    edges = [e for m, p in modules.items() for e in imports(m, p, modules)]
    assert {(e.source, e.target) for e in edges} == {("p.a", "p.b"), ("p.b", "p.a")}
    assert cycles(edges) == [["p.a", "p.b"]]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join("  " + " <-> ".join(c) for c in found)


def test_services_do_not_import_each_other():
    bad = [e for e in import_graph() if is_service(e.source) and is_service(e.target) and top(e.source) != top(e.target)]
    assert not bad, "a service imports another service:\n" + describe(bad)


def test_the_core_imports_no_service():
    allowed = ("moemesh.cli", "moemesh.launcher")
    bad = [
        e for e in import_graph()
        if top(e.source) == "moemesh" and is_service(e.target) and not any(e.source == a or e.source.startswith(a + ".") for a in allowed)
    ]
    assert not bad, "the core (moemesh/) imports a service:\n" + describe(bad)


def test_kernels_import_only_kernels():
    bad = [e for e in import_graph() if top(e.source) == "kernels" and top(e.target) != "kernels"]
    assert not bad, "kernels/ imports other parts of the project:\n" + describe(bad)
