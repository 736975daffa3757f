"""The benchmark scripts import only what exists: a sibling module they name (``common``,
``inference``, ...) is a file of benchmarks/, every name they take from it is defined there, and
any other module they import is installed (or one of the optional packages of a few scripts).
A script that would fail at import is found here, without running it."""

import ast
import importlib.util
import pathlib

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def top_level_names(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


# Imported by a few scripts, inside functions or for one mode, and absent from the test extra.
OPTIONAL = {"torch", "transformers", "t5x", "flaxformer", "seqio"}


def imports(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """(module, names taken from it) of every absolute import in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
    return found


def test_there_are_scripts():
    assert len(SCRIPTS) > 10


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_imports_exist(script):
    for module, names in imports(script):
        root = module.split(".")[0]
        sibling = BENCHMARKS / f"{root}.py"
        if sibling.exists():
            missing = set(names) - top_level_names(sibling)
            assert not missing, f"{script.name} imports {sorted(missing)} from {root}.py: absent"
        else:
            assert root in OPTIONAL or importlib.util.find_spec(root) is not None, (
                f"{script.name} imports {module}, which is neither a script of benchmarks/ nor "
                "installed"
            )


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_imports_common_before_qmoe_jax(script):
    """Importing common puts the checkout first on sys.path (common.py); a script that imports
    qmoe_jax at its top level before that would measure the installed copy instead."""
    if script.name == "common.py":
        return
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        roots = {module.split(".")[0] for module in modules}
        if "common" in roots:
            return
        assert "qmoe_jax" not in roots, f"{script.name} imports qmoe_jax before common"
