"""pytest plugin: `--without-torch` leaves out exactly the tests that need torch/transformers.

For an environment without torch (CI's Python 3.12 stage, where torch on this index is a
527 MB CUDA build; the GPU machine when run without it). Loaded on purpose only:

    PYTHONPATH=tests python -m pytest -p needs_torch --without-torch

A test needs torch when
  1. its module imports torch or transformers at the top (the module cannot even be
     imported: it is not collected), or
  2. its function, or any fixture it uses (directly or through other fixtures), imports
     torch or transformers in its body or calls tests/checkpoints.py's transformers helpers
     (make_tiny_checkpoint, load_torch_model, tiny_hf_config), or
  3. it is marked `needs_torch`.
Such tests get the `needs_torch` marker and are deselected; the summary lists the modules not
collected and the number of tests deselected, so nothing is left out silently. Without the
option the plugin changes nothing. Tests that only need *a* checkpoint use
tests/numpy_checkpoints.py, which needs neither.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from pathlib import Path

import pytest

TORCH_MODULES = ("torch", "transformers")
TORCH_HELPERS = ("make_tiny_checkpoint", "load_torch_model", "tiny_hf_config")

# What was left out, for the summary. Under pytest-xdist the workers collect; each sends its
# lists back (workeroutput) and the controller merges them.
_not_collected: set[str] = set()
_deselected: set[str] = set()


def pytest_addoption(parser):
    parser.addoption(
        "--without-torch", action="store_true",
        help="deselect the tests that need torch or transformers (tests/needs_torch.py)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_torch: needs torch or transformers")


@functools.cache
def imports_torch(path: Path) -> bool:
    """Whether the module's top level imports torch or transformers (or a submodule)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return any(isinstance(node, ast.Import | ast.ImportFrom) and _names_torch(node)
               for node in tree.body)


def _names_torch(node: ast.Import | ast.ImportFrom) -> bool:
    """Whether an import statement imports torch or transformers (or a submodule)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        names = [node.module] if node.module and node.level == 0 else []
    return any(n.split(".")[0] in TORCH_MODULES for n in names)


@functools.cache
def calls_torch_helper(fn) -> bool:
    """Whether fn's own source imports torch or transformers, or names one of
    tests/checkpoints.py's transformers helpers."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return False
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom) and _names_torch(node):
            return True
        if isinstance(node, ast.Name) and node.id in TORCH_HELPERS:
            return True
        if isinstance(node, ast.Attribute) and node.attr in TORCH_HELPERS:
            return True
    return False


def needs_torch(item) -> bool:
    if item.get_closest_marker("needs_torch"):
        return True
    fn = getattr(item, "function", None)
    if fn is not None and calls_torch_helper(fn):
        return True
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info else ()):
        if any(calls_torch_helper(d.func) for d in defs):
            return True
    return False


def pytest_ignore_collect(collection_path, config):
    if not config.getoption("--without-torch"):
        return None
    path = Path(collection_path)
    if path.suffix == ".py" and path.name.startswith("test_") and imports_torch(path):
        _not_collected.add(str(path.relative_to(config.rootpath)))
        return True
    return None


def pytest_collection_modifyitems(config, items):
    chosen, dropped = [], []
    for item in items:
        if needs_torch(item):
            item.add_marker(pytest.mark.needs_torch)
            dropped.append(item)
        else:
            chosen.append(item)
    if config.getoption("--without-torch") and dropped:
        _deselected.update(item.nodeid for item in dropped)
        config.hook.pytest_deselected(items=dropped)
        items[:] = chosen


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["needs_torch"] = [sorted(_not_collected), sorted(_deselected)]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    not_collected, deselected = getattr(node, "workeroutput", {}).get("needs_torch", ([], []))
    _not_collected.update(not_collected)
    _deselected.update(deselected)


def pytest_terminal_summary(terminalreporter, config):
    if not config.getoption("--without-torch"):
        return
    tr = terminalreporter
    tr.section("left out: need torch or transformers (--without-torch)")
    tr.write_line(f"modules not collected ({len(_not_collected)}): "
                  f"{', '.join(sorted(_not_collected))}")
    tr.write_line(f"tests deselected: {len(_deselected)}")
    for nodeid in sorted(_deselected):
        tr.write_line(f"  {nodeid}")
