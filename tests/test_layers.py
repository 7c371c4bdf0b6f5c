"""The package's layers: every nbsim module imports only modules of its own layer or below, no module
starts another layer's command line, and no import cycle exists (docs/architecture.md states these
rules; this test is what enforces them). Imports inside functions and under TYPE_CHECKING count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nbsim"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("nbsim", "nbsim.errors", "nbsim.vectors", "nbsim.cpu", "nbsim.cache", "nbsim.rng", "nbsim.devices",
     "nbsim.modes", "nbsim.sensors"),
    ("nbsim.config",),
    ("nbsim.io",),
    ("nbsim.nanobragg",),
    ("nbsim.model", "nbsim.resolve"),
    ("nbsim.kernel",),
    ("nbsim.render", "nbsim.detector"),
    ("nbsim.timing", "nbsim.reference"),
    ("nbsim.fit",),
    ("nbsim.merge",),
    ("nbsim.sweep",),
    ("nbsim.cli",),
    ("nbsim.server",),
)
"""Lowest first. A name stands for the module and, for a package, every module in it."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> int:
    matches = [(len(prefix), index) for index, names in enumerate(LAYERS) for prefix in names
               if module == prefix or (prefix != "nbsim" and module.startswith(prefix + "."))]
    if not matches:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_layers.py")
    return max(matches)[1]


def _imports(module: str) -> set[str]:
    """The nbsim modules `module` imports anywhere in its source (relative imports resolved)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "nbsim"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "nbsim":
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                found.add(submodule if submodule in MODULES else target)
    return found - {module}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_only(module):
    upward = sorted(imported for imported in _imports(module)
                    if imported != "nbsim" and _layer(imported) > _layer(module))
    assert not upward, f"{module} (layer {_layer(module)}) imports higher layers: {upward}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith("nbsim.cli")))
def test_no_module_outside_the_cli_runs_it(module):
    """A library module never starts `python -m nbsim.cli ...` (a command line is the caller's policy)."""
    tree = ast.parse(MODULES[module].read_text())
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    strings = [node.value for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]
    assert not [s for s in strings if "nbsim.cli" in s], f"{module} names nbsim.cli in a string"


def test_no_import_cycle():
    graph = {module: _imports(module) & set(MODULES) for module in MODULES}
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                cycle = path[path.index(imported):] + [imported]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if imported not in state:
                visit(imported)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_the_check_sees_an_upward_import(tmp_path):
    """The check is not vacuous: the sweep importing the CLI is found."""
    assert _layer("nbsim.sweep.plan") < _layer("nbsim.cli.bench")
    assert "nbsim.kernel.inputs" in _imports("nbsim.kernel.physics")
