"""The import layering of the tree, read from the source (every import, function-level ones too).

    server -> jpaged -> models -> pallas_kernels      (arrows: may import)

- models and pallas_kernels import nothing from jpaged or server;
- jpaged imports nothing from server;
- inside jpaged, each subpackage (or top-level module) sits on one floor of JPAGED_FLOORS
  and imports only from floors below its own: entrypoints over core over spec_decode over
  worker over sample over structured_output over the ground modules (so core never imports
  entrypoints and the worker never imports the scheduler);
- no module imports itself through a loop of other project modules;
- scripts import only public names (no `_private` name or module of the project).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jpaged", "models", "pallas_kernels", "server")
FORBIDDEN = {
    "models": ("jpaged", "server"),
    "pallas_kernels": ("jpaged", "server", "models"),
    "jpaged": ("server",),
}
# jpaged's floors, top first: a unit (subpackage, or module directly in jpaged/) imports only
# from floors below its own. jpaged/__init__.py (the public names) stands above them all.
JPAGED_FLOORS = (
    ("entrypoints", "interface"),
    ("core",),
    ("lora",),
    ("spec_decode",),
    ("worker",),
    ("sample",),
    ("structured_output",),
    ("config", "outputs", "pooling", "tokenizer"),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import statement in path."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((base, [a.name for a in node.names], node.lineno))
    return out


def project_modules() -> dict[str, Path]:
    return {
        module_name(p): p
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if "proto" not in p.parts
    }


def graph() -> dict[str, set[str]]:
    mods = project_modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for target, names, _ in imports(path):
            # `from pkg import sub` imports the module pkg.sub; `from pkg import name`, pkg.
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in mods]
            for c in subs if subs and len(subs) == len(names) else [target, *subs]:
                if c in mods and c != m:
                    edges[m].add(c)
    return edges


def test_lower_layers_never_import_higher_ones():
    problems = []
    for m, path in project_modules().items():
        top = m.split(".")[0]
        for target, _, line in imports(path):
            if target.split(".")[0] in FORBIDDEN.get(top, ()):
                problems.append(f"{path.relative_to(ROOT)}:{line}: {m} imports {target}")
    assert problems == []


def jpaged_unit(module: str) -> str | None:
    """The floor unit of a jpaged module: its subpackage or its own name; None for
    jpaged/__init__.py and modules outside jpaged."""
    parts = module.split(".")
    return parts[1] if parts[0] == "jpaged" and len(parts) > 1 else None


def test_every_jpaged_unit_has_a_floor():
    units = {jpaged_unit(m) for m in project_modules()} - {None}
    assert sorted(units - {u for floor in JPAGED_FLOORS for u in floor}) == []


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """The imports in edges from a jpaged unit to another on its own floor or above."""
    floor = {u: i for i, units in enumerate(JPAGED_FLOORS) for u in units}
    problems = []
    for m, targets in sorted(edges.items()):
        unit = jpaged_unit(m)
        if unit is None:
            continue
        for t in sorted(targets):
            other = jpaged_unit(t)
            if other is not None and other != unit and floor[other] <= floor[unit]:
                problems.append(f"{m} imports {t}")
    return problems


def test_jpaged_subpackages_import_only_lower_floors():
    assert upward_imports(graph()) == []


def test_the_floor_check_sees_upward_and_sideways_imports():
    edges = {
        "jpaged.worker.runner": {"jpaged.core.scheduler", "jpaged.sample.sampler"},
        "jpaged.entrypoints.llm": {"jpaged.interface", "jpaged.core.engine"},
        "jpaged.core.engine": {"jpaged.core.scheduler"},
        "jpaged": {"jpaged.entrypoints.llm"},
    }
    assert upward_imports(edges) == [
        "jpaged.entrypoints.llm imports jpaged.interface",
        "jpaged.worker.runner imports jpaged.core.scheduler",
    ]


def test_each_jpaged_subpackage_says_what_it_owns():
    for init in sorted((ROOT / "jpaged").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 20, f"{init.relative_to(ROOT)} has no docstring"


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_loops():
    assert cycles(graph()) == []


def test_the_loop_finder_finds_a_loop():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("script", sorted((ROOT / "scripts").glob("*.py")), ids=lambda p: p.name)
def test_scripts_import_only_public_names(script):
    private = []
    for target, names, line in imports(script):
        if target.split(".")[0] not in PACKAGES:
            continue
        bad = [n for n in names if n.startswith("_")]
        if any(part.startswith("_") and part != "__init__" for part in target.split(".")):
            bad.append(target)
        private += [f"{script.name}:{line}: {target} {n}" for n in bad]
    assert private == []
