"""The public surface is exactly what streamquake.__all__ says, every name resolves, and
importing the package pulls in none of the heavy parts (they load on first use)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import streamquake
from streamquake.faults import contract


def _bound_names(module: ModuleType) -> set[str]:
    """The public names a module binds itself, read from its source (httpx guards its exports
    this way): what it defines at the top (classes, functions, aliases) and what it imports from
    streamquake, lazily under TYPE_CHECKING too, dunders such as ``__version__`` included."""
    assert module.__file__ is not None
    body = ast.parse(Path(module.__file__).read_text()).body
    top = [n for stmt in body for n in (stmt.body if isinstance(stmt, ast.If) else [stmt])]
    names: set[str] = set()
    for node in top:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("streamquake"):
            names |= {a.asname or a.name for a in node.names}
    return {n for n in names if not n.startswith("_") or (n.startswith("__") and n not in (
        "__all__", "__getattr__"))}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("module", [streamquake, contract], ids=lambda m: m.__name__)
def test_all_is_what_the_module_binds_and_every_name_resolves(module: ModuleType) -> None:
    exported = list(module.__all__)
    assert exported == sorted(set(exported))
    assert set(exported) == _bound_names(module)
    for name in exported:
        assert getattr(module, name) is not None, name
    with pytest.raises(AttributeError):
        _ = module.not_a_public_name


@pytest.mark.timeout(30)
def test_the_guard_sees_a_name_left_out() -> None:
    # A name the contract defines but does not export is caught, not silently private.
    assert "FaultType" in _bound_names(contract)
    assert {"TYPE_CHECKING", "dataclass", "Callable"}.isdisjoint(_bound_names(contract))


@pytest.mark.timeout(30)
def test_importing_the_package_is_cheap() -> None:
    code = ("import sys, streamquake; print(sorted(m for m in ('pydantic', 'streamquake.run', "
            "'streamquake.faults', 'pyroute2', 'aiohttp') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
