"""The structure, checked: the contract package sits below the coordinator and the worker, every command kind has
a payload model and a worker handler (and every handler a kind), and no production module holds a test hook."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import dynaresize
from dynaresize.contract.protocol import COMMANDS, CommandKind

pytestmark = pytest.mark.unit

PKG = Path(dynaresize.__file__).parent


def _modules(sub: str = "") -> list[Path]:
    return sorted((PKG / sub).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level imports, ``importlib.import_module("...")`` and
    ``__import__("...")`` with a literal name included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            out.add(node.module or "")
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.add(node.args[0].value)
    return out


def _importing(paths: list[Path], *packages: str) -> dict[str, list[str]]:
    bad = {}
    for p in paths:
        hits = sorted(m for m in _imports(p) if any(m == pkg or m.startswith(pkg + ".") for pkg in packages))
        if hits:
            bad[str(p.relative_to(PKG.parent)) if p.is_relative_to(PKG.parent) else str(p)] = hits
    return bad


def test_the_walk_sees_function_level_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from dynaresize.job.batching import x\n    __import__('dynaresize.job.cli')\n")
    assert _importing([f], "dynaresize.job") == {str(f): ["dynaresize.job.batching", "dynaresize.job.batching.x", "dynaresize.job.cli"]}


def test_no_worker_module_imports_the_coordinators_package():
    assert _modules("worker")
    assert _importing(_modules("worker"), "dynaresize.job") == {}


def test_the_contract_package_imports_neither_the_coordinator_nor_the_worker():
    assert _modules("contract")
    assert _importing(_modules("contract"), "dynaresize.job", "dynaresize.worker") == {}


def test_no_production_module_reads_a_test_only_environment_variable():
    hits = []
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "DYNARESIZE_TEST" in node.value:
                hits.append(f"{p.relative_to(PKG.parent)}:{node.lineno}")
    assert hits == []


def _handlers() -> dict[str, object]:
    from dynaresize.worker.core import Worker

    return {name[len("_cmd_"):]: fn for name, fn in inspect.getmembers(Worker, inspect.isfunction) if name.startswith("_cmd_")}


def test_every_command_kind_has_a_payload_model_and_a_worker_handler_and_back():
    handlers = _handlers()
    assert sorted(m.value for m in CommandKind) == sorted(COMMANDS)
    assert sorted(handlers) == sorted(COMMANDS), "a kind without a handler, or a production handler without a kind"
    for kind, spec in COMMANDS.items():  # the handler takes exactly the payload's fields
        params = inspect.signature(handlers[kind]).parameters.values()
        named = {p.name for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD}
        assert named == set(spec.payload.model_fields), kind


def test_production_hooks_add_nothing_and_the_test_commands_are_not_contract_kinds():
    from dynaresize.worker.hooks import Hooks
    from tests.support.hooks import TEST_COMMANDS

    assert Hooks().commands() == {}
    assert Hooks().point(0, "switch_role.offload", "step-3") is None
    assert TEST_COMMANDS and not set(TEST_COMMANDS) & set(COMMANDS)
