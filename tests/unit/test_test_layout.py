"""Rules of the test tree that pytest's default import mode makes easy to break.

Test directories are not packages, so pytest puts each on ``sys.path`` and imports their
modules by bare name: two helper modules with the same file name in two directories, or
``from conftest import …`` (every directory's conftest is named ``conftest``), import
whichever came first, and a full run fails at collection while each directory passes.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_no_test_module_imports_from_conftest() -> None:
    offenders = [
        str(path.relative_to(TESTS))
        for path in TESTS.rglob("*.py")
        if re.search(r"^\s*(from conftest import|import conftest)", path.read_text(),
                     re.MULTILINE)
    ]
    assert offenders == [], f"move the shared helpers to a uniquely named module: {offenders}"


def test_helper_module_names_are_unique_across_test_directories() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name in ("conftest.py", "__init__.py"):
            continue
        by_name[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert clashes == {}, f"rename so each module name is unique: {clashes}"
