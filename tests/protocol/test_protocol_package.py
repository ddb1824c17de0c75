"""The package's surface: everything public is re-exported from `kibotos.protocol`, and
it imports nothing of ctrl, the node or trio (both roles import it; it must stay a leaf
of plain types)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import kibotos.protocol as protocol

PACKAGE = Path(protocol.__file__).parent


def test_all_names_each_export_once() -> None:
    assert len(set(protocol.__all__)) == len(protocol.__all__)
    missing = [name for name in protocol.__all__ if not hasattr(protocol, name)]
    assert missing == []


def test_every_message_and_command_type_is_exported() -> None:
    exported = set(protocol.__all__)
    for info in pkgutil.walk_packages([str(PACKAGE)], "kibotos.protocol."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and value.__module__ == module.__name__ and \
                    not name.startswith("_") and name not in ("Part",):
                assert name in exported, f"{info.name}.{name} is not exported"


def test_it_imports_no_role_and_no_trio() -> None:
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith(("kibotos.ctrl", "kibotos.node", "trio")), \
                    f"{path.relative_to(PACKAGE)} imports {name}"
