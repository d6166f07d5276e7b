"""The library's shape, as issue "one core that features compose on" set it: torch's private
internals reached only through ``_torch.py``, and no function too tangled to read."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parent.parent / "inputaware_optim"
MODULES = sorted(LIBRARY.glob("*.py"))
MAX_COMPLEXITY = 20  # radon's cyclomatic complexity, the bar of CONTRIBUTING.md


def _private_torch_uses(tree: ast.AST) -> list[str]:
    """``torch._x`` attribute chains and imports from a private torch module, as written."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            if any(part.startswith("_") for part in node.module.split(".")) or any(
                alias.name.startswith("_") for alias in node.names
            ):
                found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if "._" in a.name]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id == "torch":
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", [p for p in MODULES if p.name != "_torch.py"], ids=lambda p: p.name)
def test_torch_internals_are_reached_only_through_the_internals_module(path: Path) -> None:
    uses = _private_torch_uses(ast.parse(path.read_text()))
    assert not uses, f"{path.name} reaches into torch's internals (move it to _torch.py, with a test): {uses}"


def test_the_check_finds_private_torch_uses() -> None:
    source = "import torch\nfrom torch.utils._pytree import tree_map\nx = torch._C._foo()\ny = torch.nn.Linear\n"
    assert len(_private_torch_uses(ast.parse(source))) == 3  # the import, torch._C._foo and torch._C


def test_no_library_function_is_above_the_complexity_bar() -> None:
    from radon.complexity import cc_visit
    from radon.visitors import Function

    tangled = [
        f"{path.name}: {block.fullname} ({block.complexity})"
        for path in MODULES
        for block in cc_visit(path.read_text())
        if isinstance(block, Function) and block.complexity > MAX_COMPLEXITY  # methods come as their own blocks
    ]
    assert not tangled, f"above radon complexity {MAX_COMPLEXITY}, split them: {tangled}"
