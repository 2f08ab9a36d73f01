"""The import layering of the tree, read from the source (every import, function-level ones too).

    server -> jpaged -> models -> pallas_kernels      (arrows: may import)

- models and pallas_kernels import nothing from jpaged or server;
- jpaged imports nothing from server;
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
