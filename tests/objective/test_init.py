"""Tests for the prefzoo.objective package itself: its public API and its import boundary."""

import ast
import inspect
import sys
from pathlib import Path

import prefzoo.objective as objective

PACKAGE_DIR = Path(objective.__file__).parent


def test_every_exported_name_exists():
    for name in objective.__all__:
        assert hasattr(objective, name), name
    assert len(set(objective.__all__)) == len(objective.__all__)


def test_objective_imports_nothing_else_from_prefzoo():
    """DESIGN.md: objective/ imports nothing else of prefzoo (only torch, numpy and stdlib), but the leaf error
    module prefzoo.errors (ObjectiveError is a PrefzooError). The whole house's directions: tests/test_architecture.py."""
    allowed_third_party = {"torch", "numpy"}
    for path in sorted(PACKAGE_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level > 0:  # relative: must stay inside the package
                    assert node.level == 1, f"{path.name} imports outside objective/"
                    continue
                if node.module == "prefzoo.errors":
                    continue
                roots = [node.module.split(".")[0]]
            else:
                continue
            for root in roots:
                assert root != "prefzoo", f"{path.name} imports {root} (absolute prefzoo import)"
                assert root in allowed_third_party or root in sys.stdlib_module_names, (
                    f"{path.name} imports {root}")


def test_public_functions_document_shape_raises_and_source():
    """Every public function or class carries the docstring sections of the conventions."""
    for name in objective.__all__:
        obj = getattr(objective, name)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)) or name in {"KLController"}:
            continue
        doc = inspect.getdoc(obj) or ""
        if name == "ObjectiveError":
            assert "Source" in doc
            continue
        for section in ("Shape", "Units", "Raises", "Source"):
            assert section in doc, f"{name} docstring lacks {section!r}"
