"""The plugin SDK (`kibotos.sdk`): one option-check format for every backend, a light
import for the ``direct`` launcher, and docs/plugins.md naming what it exports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kibotos.sdk
import kibotos.sdk.guest
from kibotos.sdk import InvalidArgument, backend_options

DOC = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()


def test_unknown_options_are_refused_naming_the_table_and_what_is_known() -> None:
    with pytest.raises(InvalidArgument) as err:
        backend_options("vmm", "acme", {"colour": 1, "size": 2}, {"speed", "path"})
    assert err.value.message == "[vmm.acme]: unknown options colour, size (known: path, speed)"
    with pytest.raises(InvalidArgument) as err:
        backend_options("placement", "first-fit", {"weight": 2})
    assert err.value.message == "placement policy first-fit: unknown option weight (it takes none)"
    with pytest.raises(InvalidArgument, match=r"^\[supervisor\.acme\]: the options must be a "):
        backend_options("supervisor", "acme", ["state_dir"])  # type: ignore[arg-type]


@pytest.mark.parametrize(("read", "value", "problem"), [
    (lambda o: o.text("x", "d"), "", "must be a non-empty string, got ''"),
    (lambda o: o.text("x", "d"), 5, "must be a non-empty string, got 5"),
    (lambda o: o.path("x", "/d"), 5, "must be a path, got 5"),
    (lambda o: o.path("x", "/d", absolute=True), "rel/dir", "must be an absolute path, got "
                                                            "'rel/dir'"),
    (lambda o: o.integer("x", 1, 1, 9), True, "must be an integer from 1 to 9, got True"),
    (lambda o: o.integer("x", 1, 1, 9), 10, "must be an integer from 1 to 9, got 10"),
    (lambda o: o.integer("x", 1, 1, 9), "3", "must be an integer from 1 to 9, got '3'"),
    (lambda o: o.seconds("x", 1.0), "20", "must be a positive number of seconds, got '20'"),
    (lambda o: o.seconds("x", 1.0), 0, "must be a positive number of seconds, got 0"),
    (lambda o: o.seconds("x", 1.0, most=60), 61, "must be a positive number of seconds up to "
                                                 "60, got 61"),
    (lambda o: o.flag("x", False), "yes", "must be true or false, got 'yes'"),
    (lambda o: o.choice("x", "a", ("a", "b")), "c", "must be one of a, b, got 'c'"),
])
def test_each_reader_refuses_a_wrong_value_in_the_one_format(read, value, problem) -> None:
    opts = backend_options("vmm", "acme", {"x": value}, {"x"})
    with pytest.raises(InvalidArgument) as err:
        read(opts)
    assert err.value.message == f"[vmm.acme] x: {problem}"


def test_readers_give_the_value_or_the_default_without_coercing() -> None:
    opts = backend_options("supervisor", "acme", {
        "name": "n", "dir": Path("/p"), "count": 3, "grace": 0.5, "on": False, "mode": "b",
    }, {"name", "dir", "count", "grace", "on", "mode", "unset"})
    assert opts.text("name", "d") == "n"
    assert opts.text("unset", "d") == "d"
    assert opts.text_or_none("unset") is None
    assert opts.path("dir", "/d") == Path("/p")
    assert opts.path("unset", "/d") == Path("/d")
    assert opts.path_or_none("unset") is None
    assert opts.integer("count", 1, 0, 5) == 3
    assert opts.integer("unset", 1, 0, 5) == 1
    assert opts.seconds("grace", 60.0) == 0.5
    assert opts.seconds("unset", 60.0) == 60.0
    assert opts.flag("on", True) is False
    assert opts.flag("unset", True) is True
    assert opts.choice("mode", "a", ("a", "b")) == "b"
    assert "dir" in opts
    assert "unset" not in opts
    with pytest.raises(InvalidArgument) as err:
        opts.required_path("unset")
    assert err.value.message == "[supervisor.acme] unset: required, not given"


def test_every_built_in_backend_refuses_an_unknown_option_in_the_one_format() -> None:
    from kibotos.plugins import load_plugins

    regs = load_plugins()
    where = {"vmm": "[vmm.{}]", "supervisor": "[supervisor.{}]",
             "storage_driver": "storage driver {}", "placement": "placement policy {}"}
    for info in regs.infos:
        if info.source != "builtin":
            continue
        with pytest.raises(InvalidArgument) as err:
            regs.registry(info.kind).get(info.name)({"no_such_option": 1})
        assert err.value.message.startswith(
            where[info.kind].format(info.name) + ": unknown option no_such_option ("), info


def test_the_sdk_root_does_not_import_trio() -> None:
    """The ``direct`` launcher imports it in a fresh interpreter at every unit start."""
    code = "import sys, kibotos.sdk; print('trio' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": ""}).stdout
    assert out.strip() == "False"


def test_docs_list_every_name_the_sdk_exports() -> None:
    section = DOC[DOC.index("## The plugin SDK"):]
    section = section[:section.index("\n## ", 4)]
    for module in (kibotos.sdk, kibotos.sdk.guest):
        assert f"`{module.__name__}`" in section
        missing = [name for name in module.__all__ if f"`{name}`" not in section]
        assert missing == [], f"docs/plugins.md, 'The plugin SDK', lacks {missing}"


def test_the_example_plugin_of_the_docs_loads_and_ranks(write_module) -> None:
    from kibotos.plugins import load_plugins
    from kibotos.sdk import NodeCapacity, PlacementRequest

    example = DOC.split("# acme_kibotos/__init__.py\n", 1)[1].split("```", 1)[0]
    regs = load_plugins(test_modules=[write_module("plugintest_docs_example", example)])
    policy = regs.placement.get("acme-first-fit")({})
    nodes = [NodeCapacity(n, 1000, 2**30, 0, 0) for n in ("node-b", "node-a")]
    assert policy.rank(PlacementRequest(100, 2**20), nodes) == ["node-b", "node-a"]
    with pytest.raises(InvalidArgument, match=r"^placement policy acme-first-fit: unknown "):
        regs.placement.get("acme-first-fit")({"weight": 1})


def test_the_lazy_exports_the_type_checking_imports_and_all_agree() -> None:
    """`kibotos.sdk` imports each name on first use; mypy reads its TYPE_CHECKING block."""
    import ast
    import importlib

    source = Path(kibotos.sdk.__file__).read_text()
    declared: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom)
                for alias in stmt.names:
                    # ``from kibotos(.core) import atomicfile`` imports a module
                    declared[alias.name] = (f"{stmt.module}.{alias.name}"
                                            if stmt.module in ("kibotos", "kibotos.core")
                                            else str(stmt.module))
    lazy = {**kibotos.sdk._MODULES, **kibotos.sdk._NAMES}
    assert declared == lazy
    assert sorted(kibotos.sdk.__all__) == sorted(lazy)
    for name, where in kibotos.sdk._MODULES.items():
        assert getattr(kibotos.sdk, name) is importlib.import_module(where)
    for name, where in kibotos.sdk._NAMES.items():
        assert getattr(kibotos.sdk, name) is getattr(importlib.import_module(where), name)
    with pytest.raises(ImportError, match=r"cannot import name 'Typo' from 'kibotos\.sdk'"):
        exec("from kibotos.sdk import Typo", {})


def test_the_direct_launcher_takes_only_what_it_uses_from_the_sdk() -> None:
    code = ("import sys, kibotos_direct.launch; "
            "print(sorted(m for m in ('kibotos.backends', 'kibotos.vmm_launch', "
            "'kibotos.platform.cache', 'kibotos.sdk.options', 'trio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
