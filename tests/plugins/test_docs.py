"""Every hook is documented in docs/plugins.md (name and signature) and exercised by a
test here; every method of every backend contract is documented too (after datasette's
test_docs.py)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from kibotos import hookspecs
from kibotos.plugins import KINDS, PROTOCOLS, load_plugins

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "plugins.md").read_text()
HOOKS = sorted(
    (name, fn) for name, fn in vars(hookspecs).items()
    if callable(fn) and hasattr(fn, f"{hookspecs.PROJECT}_spec")
)


def signature(name: str, fn) -> str:
    return f"{name}({', '.join(inspect.signature(fn).parameters)})"


def test_the_hook_specs_are_the_kinds_the_registries_serve():
    assert [name for name, _ in HOOKS] == sorted(f"kibotos_register_{k}" for k in KINDS)


@pytest.mark.parametrize(("name", "fn"), HOOKS, ids=[n for n, _ in HOOKS])
def test_hook_is_documented_with_its_signature_and_an_example(name, fn):
    sig = signature(name, fn)
    heading = f"### `{sig}`"
    assert heading in DOC, f"docs/plugins.md lacks the section {heading}"
    section = DOC.split(heading, 1)[1].split("\n### ", 1)[0]
    assert f"def {name}(register):" in section, f"no example for {name}"
    assert "@hookimpl" in section


@pytest.mark.parametrize(("name", "fn"), HOOKS, ids=[n for n, _ in HOOKS])
def test_hook_is_exercised_by_a_test(name, fn):
    here = Path(__file__).parent
    files = {p.name: p.read_text() for p in here.glob("*.py") if p.name != "test_docs.py"}
    # A plugin module here implements it, and a test here names it ...
    assert any(re.search(rf"^def {name}\(", text, re.M) for text in files.values()), (
        f"no plugin module in tests/plugins implements {name}"
    )
    assert any(name in text for fname, text in files.items() if fname.startswith("test_")), (
        f"no test in tests/plugins names {name}"
    )
    # ... and it really runs: the test plugin's implementation fills its kind's registry.
    kind = name.removeprefix("kibotos_register_")
    regs = load_plugins(test_modules=["plugintest_allkinds"])
    assert any(i.kind == kind and i.source == "test" for i in regs.infos)


@pytest.mark.parametrize("kind", KINDS)
def test_every_contract_method_is_documented(kind):
    proto = PROTOCOLS[kind]
    methods = [n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")]
    assert methods
    for method in methods:
        assert f"`{method}(" in DOC or f"`async {method}(" in DOC, (
            f"docs/plugins.md does not document {proto.__name__}.{method}"
        )
