"""The architecture's import rules, checked over the source tree with `ast` (the way
tests/guest/test_agent_package.py checks the guest agent), so a change that breaks one
fails here and names the line, instead of eroding the layers unnoticed.

1. The role packages (`kibotos.ctrl`, `kibotos.node`, `kibotos.dataplane`) never import
   each other, with two exceptions: `kibotos.protocol`, the messages every role shares
   (it is not a role, so everyone may import it), and the data plane's control client,
   the modules the node drives its data-plane process with (`NODE_USES_OF_DATAPLANE`).
   The gateways (`kibotos.gateway`) are a role too, clients of ctrl's HTTP API and of
   the data plane like `kibo`: they import only the data plane's client ends
   (`GATEWAY_USES_OF_DATAPLANE`), never ctrl or the node.
   Imports under ``if TYPE_CHECKING:`` count too: a type is a dependency.
2. Shared modules (the rest of `kibotos`) import no role package: a role that imports
   one must not reach another role through it.  The entry points `kibotos.cli` and
   `kibotos.dev`, which start and assemble the roles, are exempt.
3. Plugins (``plugins/*/kibotos_*``) import kibotos only through the plugin SDK
   (`kibotos.sdk`, docs/plugins.md), and another built-in plugin only when their
   ``pyproject.toml`` declares its distribution.
4. The synchronous layers `kibotos.ctrl.model`, `kibotos.ctrl.pools` and
   `kibotos.ctrl.wire` never import trio, directly or through any kibotos module they
   import (the runtime closure, parent packages included).
5. No import cycle among product modules.  Runtime imports only: those at module level
   and inside functions (they run when called), not those under ``if TYPE_CHECKING:``,
   which never run.  The guest agent (`kibotos/guest/kibotos_guest`) is left out: it is
   standard-library-only and separate (tests/guest checks it), and its dispatcher imports
   its request handlers lazily by design.  A second test also counts the
   ``TYPE_CHECKING`` imports, with the known cycles listed.
6. Everywhere under `kibotos`, the guest agent's package included: no module over 600
   lines and no folder over 15 modules (``__init__.py`` not counted), so a folder that
   grows past 15 fails here until it is split.
7. The layer order of docs/architecture.md ("Layout and layer order"), within ctrl
   (``wire``, ``store`` → ``model``, ``pools`` → ``live`` → ``api`` → ``serve``) and
   within the node (``host``, ``records`` → ``storage``, ``runtime`` → ``instances`` →
   ``session``, ``dataplane``, ``checks`` → ``serve``): a module imports only from its
   own layer and those before it (``TYPE_CHECKING`` imports count).  The imports that
   broke it when the rule came are listed as known exceptions, each to be deleted when
   its cause is fixed; a subfolder in no layer is reported too.

Each rule is a function over a tree root that returns its violations; the test of the
real tree expects none, and a second test plants a violation in a small tree under
``tmp_path`` and expects the rule to report it, so no rule can pass by checking nothing.
"""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

ROLES = ("kibotos.ctrl", "kibotos.node", "kibotos.dataplane", "kibotos.gateway")
ENTRY_POINTS = ("kibotos.cli", "kibotos.dev")
#: The data plane's control client: what the node imports to build, start, feed and
#: scrape its data-plane process (kibotos/node/dataplane/).  Nothing else of the data plane.
NODE_USES_OF_DATAPLANE = frozenset({
    "kibotos.dataplane.process.build",  # the build identity, for adoption
    "kibotos.dataplane.process.control",  # the control socket's client end
    "kibotos.dataplane.process.listen_handover",  # a generation's socket: drain, its metrics
    "kibotos.dataplane.process.metrics",  # summing counters over generations
    "kibotos.dataplane.process.state",  # the state message the node hands over
})
#: The data plane's client ends: what a gateway runs processes and moves files with.
GATEWAY_USES_OF_DATAPLANE = frozenset({
    "kibotos.dataplane.clients.client",  # exec over a WebSocket
    "kibotos.dataplane.clients.exec_wire",  # the exec request's shape
    "kibotos.dataplane.clients.files_client",  # the file endpoints
    "kibotos.dataplane.clients.ports_client",  # port streams (the Exposure gateway)
    "kibotos.dataplane.clients.user_name",  # the rule for a guest user name (envd's user)
})
SDK = "kibotos.sdk"
SYNCHRONOUS = ("kibotos.ctrl.model", "kibotos.ctrl.pools", "kibotos.ctrl.wire")
GUEST_AGENT = "kibotos.guest.kibotos_guest"
SIZED = "kibotos"
MAX_LINES = 600
MAX_MODULES = 15

#: Cycles that exist only through ``if TYPE_CHECKING:`` imports: a collaborator typed
#: as the service that hands it ``self``.  Known exceptions, to be removed when fixed.
KNOWN_TYPE_CHECKING_CYCLES = {
    # The guest file and port operations are typed against the channel whose stream
    # tables they share (kibotos/guest/files.py, ports.py); a narrow channel interface
    # would end this one.
    ("kibotos.guest.client", "kibotos.guest.files", "kibotos.guest.ports"),
}


#: Layers of docs/architecture.md: a module of layer n imports from layers <= n only.
#: Modules directly in the role's folder (``serve.py``, the node's ``metrics.py``) are
#: the last layer.
LAYERS = {
    "kibotos.ctrl": {"wire": 0, "store": 0, "model": 1, "pools": 1, "live": 2, "api": 3},
    "kibotos.node": {"host": 0, "records": 0, "storage": 1, "runtime": 1, "network": 1,
                     "instances": 2,
                     "session": 3, "dataplane": 3, "egress": 3, "checks": 3},
}
TOP_LAYER = 4

#: Imports against the layer order that predate the rule (importer, imported).  Delete an
#: entry when its import goes; the test says which ones went.
KNOWN_LAYER_EXCEPTIONS = {
    # ctrl's shared context and session hub hold the HTTP layer's metrics and token checks.
    ("kibotos.ctrl.live.context", "kibotos.ctrl.api.metrics"),
    ("kibotos.ctrl.live.node_sessions", "kibotos.ctrl.api.auth"),
    # Request shapes reuse the Workspace record rules (label and name checks).
    ("kibotos.ctrl.wire.volumes", "kibotos.ctrl.model.workspace_records"),
    ("kibotos.ctrl.wire.workspaces", "kibotos.ctrl.model.workspace_records"),
    ("kibotos.ctrl.wire.transfers", "kibotos.ctrl.model.workspace_records"),
    # Command arguments and Instance states, which move to kibotos/protocol/ (item 1).
    ("kibotos.node.records.instance_dirs", "kibotos.node.instances.contract"),
    ("kibotos.node.records.registry", "kibotos.node.instances.contract"),
    # The Instance object itself, which storage and records work on.
    ("kibotos.node.records.instance_dirs", "kibotos.node.instances.lifecycle"),
    ("kibotos.node.storage.holder_watch", "kibotos.node.instances.lifecycle"),
    ("kibotos.node.storage.volume_ops", "kibotos.node.instances.lifecycle"),
    # Storage fetching from ctrl's artifact store through the session's HTTP helper.
    ("kibotos.node.storage.template_cache", "kibotos.node.session.ctrl_http"),
    ("kibotos.node.storage.transfer", "kibotos.node.session.ctrl_http"),
    # The host layout names the pools' directories; adoption retries with the backoff.
    ("kibotos.node.host.layout", "kibotos.node.storage.pools.dirs"),
    ("kibotos.node.instances.adoption_background", "kibotos.node.session.backoff"),
}


# ---------------------------------------------------------------------------- the tree


@dataclass(frozen=True)
class Import:
    """One imported name: `target` is a module of the tree when the name is one, else
    what the statement names (``trio``, ``os.path``, a class's module)."""

    module: str
    path: Path
    line: int
    target: str
    type_checking: bool


def modules(root: Path) -> dict[str, Path]:
    """Every module of the product: `kibotos` and each built-in plugin's package."""
    found: dict[str, Path] = {}
    for path in sorted((root / "kibotos").rglob("*.py")):
        found[_name(path.relative_to(root))] = path
    for path in sorted((root / "plugins").glob("*/kibotos_*/**/*.py")):
        plugin_dir = root / "plugins" / path.relative_to(root).parts[1]
        found[_name(path.relative_to(plugin_dir))] = path
    return found


def _name(relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(root: Path) -> Iterator[Import]:
    """Every import statement of every product module, names resolved (relative ones
    too); ``from a import b`` names ``a.b`` when that is a module of the tree."""
    tree = modules(root)
    for name, path in tree.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        yield from _walk(ast.parse(path.read_text()).body, name, path, package, tree,
                         type_checking=False)


def _walk(body: Iterable[ast.stmt], name: str, path: Path, package: str,
          tree: dict[str, Path], *, type_checking: bool) -> Iterator[Import]:
    for node in body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(name, path, node.lineno, alias.name, type_checking)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield Import(name, path, node.lineno, full if full in tree else base,
                             type_checking)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _walk(node.body, name, path, package, tree, type_checking=True)
            yield from _walk(node.orelse, name, path, package, tree,
                             type_checking=type_checking)
        else:  # a def, class, with, try, loop…: imports in its body run too
            for child in ast.iter_child_nodes(node):
                inner = [child] if isinstance(child, ast.stmt) else (
                    child.body if isinstance(child, ast.excepthandler | ast.match_case)
                    else [])
                yield from _walk(inner, name, path, package, tree,
                                 type_checking=type_checking)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _where(imp: Import, root: Path) -> str:
    return f"{imp.path.relative_to(root)}:{imp.line} imports {imp.target}"


def _role(name: str) -> str | None:
    return next((r for r in ROLES if _within(name, r)), None)


def _resolve(target: str, tree: dict[str, Path]) -> str | None:
    """The module of the tree a target names (a name inside a module: that module)."""
    while target and target not in tree:
        target = target.rpartition(".")[0]
    return target or None


# ---------------------------------------------------------------------------- rules


def role_violations(root: Path) -> list[str]:
    """Rule 1: a role imports another role only through `NODE_USES_OF_DATAPLANE` (the
    node) and `GATEWAY_USES_OF_DATAPLANE` (the gateways)."""
    out = []
    for imp in imports(root):
        own, other = _role(imp.module), _role(imp.target)
        if own is None or other is None or own == other:
            continue
        if own == "kibotos.node" and _within(imp.target, "kibotos.dataplane") and any(
                _within(imp.target, m) for m in NODE_USES_OF_DATAPLANE):
            continue
        if own == "kibotos.gateway" and any(
                _within(imp.target, m) for m in GATEWAY_USES_OF_DATAPLANE):
            continue
        out.append(f"{_where(imp, root)} ({own} never imports {other})")
    return out


def shared_violations(root: Path) -> list[str]:
    """Rule 2: shared modules import no role."""
    out = []
    for imp in imports(root):
        if not _within(imp.module, "kibotos") or _role(imp.module) is not None or any(
                _within(imp.module, e) for e in ENTRY_POINTS):
            continue
        other = _role(imp.target)
        if other is not None:
            out.append(f"{_where(imp, root)} (shared modules import no role: {other})")
    return out


def _plugin_packages(root: Path) -> dict[str, tuple[str, set[str]]]:
    """package -> (its distribution, the distributions it declares)."""
    found = {}
    for project in sorted((root / "plugins").glob("*/pyproject.toml")):
        meta = tomllib.loads(project.read_text())["project"]
        for package in project.parent.glob("kibotos_*/__init__.py"):
            found[package.parent.name] = (meta["name"], set(meta.get("dependencies", [])))
    return found


def plugin_violations(root: Path) -> list[str]:
    """Rule 3: plugins import kibotos only through the SDK, and declared plugins only."""
    packages = _plugin_packages(root)
    out = []
    for imp in imports(root):
        own = imp.module.split(".")[0]
        if own not in packages:
            continue
        top = imp.target.split(".")[0]
        if top == "kibotos" and not _within(imp.target, SDK):
            out.append(f"{_where(imp, root)} (plugins import kibotos only through {SDK})")
        elif top in packages and top != own and packages[top][0] not in packages[own][1]:
            out.append(f"{_where(imp, root)} (a plugin imports another only when its "
                       f"pyproject.toml declares {packages[top][0]})")
    return out


def _runtime_graph(root: Path, *, type_checking: bool = False) -> dict[str, set[str]]:
    tree = modules(root)
    graph: dict[str, set[str]] = {name: set() for name in tree}
    for imp in imports(root):
        if imp.type_checking and not type_checking:
            continue
        target = _resolve(imp.target, tree)
        if target is not None and target != imp.module:
            graph[imp.module].add(target)
    return graph


def trio_violations(root: Path) -> list[str]:
    """Rule 4: nothing the synchronous layers import at run time imports trio."""
    tree = modules(root)
    graph = _runtime_graph(root)
    trio_users = {imp.module: imp for imp in imports(root)
                  if not imp.type_checking and _within(imp.target, "trio")}
    out = []
    for start in sorted(n for n in tree if any(_within(n, s) for s in SYNCHRONOUS)):
        chain = {start: [start]}
        todo = [start]
        while todo:
            name = todo.pop(0)
            if name in trio_users:
                path = " -> ".join(chain[name])
                out.append(f"{start} imports trio: {path} ({_where(trio_users[name], root)})")
                break
            parents = [p for p in (name.rsplit(".", i)[0]
                                   for i in range(1, name.count(".") + 1)) if p in tree]
            for nxt in sorted(graph[name] | set(parents)):
                if nxt not in chain:
                    chain[nxt] = [*chain[name], nxt]
                    todo.append(nxt)
    return out


def import_cycles(root: Path, *, type_checking: bool = False) -> set[tuple[str, ...]]:
    """Rule 5: the strongly connected sets of product modules (Tarjan), sorted."""
    graph = {name: {t for t in targets if not _within(t, GUEST_AGENT)}
             for name, targets in _runtime_graph(root, type_checking=type_checking).items()
             if not _within(name, GUEST_AGENT)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: set[tuple[str, ...]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                cycles.add(tuple(sorted(members)))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return cycles


def _layer(name: str, tree: dict[str, Path]) -> tuple[str, int | None] | None:
    """(role, layer) of a module of ctrl or the node; layer None: in no layer."""
    for role, table in LAYERS.items():
        if _within(name, role) and name != role:
            rest = name[len(role) + 1:].split(".")
            if len(rest) == 1 and tree[name].name != "__init__.py":
                return role, TOP_LAYER  # a module directly in the role's folder
            return role, table.get(rest[0])
    return None


def layer_violations(root: Path) -> set[tuple[str, str]]:
    """Rule 7: (importer, imported) pairs against the layer order, and (module, "") for a
    module in a subfolder no layer names."""
    tree = modules(root)
    out: set[tuple[str, str]] = set()
    for name in tree:
        where = _layer(name, tree)
        if where is not None and where[1] is None:
            out.add((name, ""))
    for imp in imports(root):
        target = _resolve(imp.target, tree)
        own, other = _layer(imp.module, tree), _layer(target, tree) if target else None
        if own is None or other is None or own[0] != other[0]:
            continue
        if own[1] is not None and other[1] is not None and other[1] > own[1]:
            out.add((imp.module, str(target)))
    return out


def size_violations(root: Path) -> list[str]:
    """Rule 6: small modules in small folders."""
    out = []
    counts: dict[Path, int] = defaultdict(int)
    for path in sorted((root / SIZED).rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            out.append(f"{path.relative_to(root)} has {lines} lines (at most {MAX_LINES})")
        if path.name != "__init__.py":
            counts[path.parent] += 1
    out += [f"{folder.relative_to(root)} has {n} modules (at most {MAX_MODULES})"
            for folder, n in sorted(counts.items())
            if n > MAX_MODULES]
    return out


# ---------------------------------------------------------------------------- the real tree


def test_the_tree_is_what_the_rules_walk() -> None:
    tree = modules(ROOT)
    assert {"kibotos.ctrl.serve", "kibotos.node.serve", "kibotos.dataplane.process.serve",
            "kibotos.sdk", "kibotos_qemu.backend", "kibotos_direct.launch"} <= set(tree)
    assert len(list(imports(ROOT))) > 2000


def test_roles_import_each_other_only_through_the_declared_seams() -> None:
    assert role_violations(ROOT) == []
    used = {imp.target for imp in imports(ROOT)
            if _within(imp.module, "kibotos.node") and _within(imp.target, "kibotos.dataplane")}
    assert used == NODE_USES_OF_DATAPLANE  # the seam is exactly what the node uses


def test_shared_modules_import_no_role() -> None:
    assert shared_violations(ROOT) == []


def test_plugins_import_only_the_sdk() -> None:
    assert plugin_violations(ROOT) == []


def test_the_synchronous_ctrl_layers_never_import_trio() -> None:
    assert trio_violations(ROOT) == []


def test_no_runtime_import_cycle() -> None:
    assert import_cycles(ROOT) == set()


def test_type_checking_imports_add_only_the_known_cycles() -> None:
    found = import_cycles(ROOT, type_checking=True)
    assert found - KNOWN_TYPE_CHECKING_CYCLES == set(), "a new import cycle"
    assert KNOWN_TYPE_CHECKING_CYCLES - found == set(), (
        "a known cycle is gone: delete it from KNOWN_TYPE_CHECKING_CYCLES")


def test_modules_and_folders_stay_small() -> None:
    assert size_violations(ROOT) == []


def test_modules_import_only_from_their_layer_and_those_before() -> None:
    found = layer_violations(ROOT)
    assert found - KNOWN_LAYER_EXCEPTIONS == set(), "an import against the layer order"
    assert KNOWN_LAYER_EXCEPTIONS - found == set(), (
        "a known exception is gone: delete it from KNOWN_LAYER_EXCEPTIONS")


# ---------------------------------------------------------------------------- planted


def plant(root: Path, files: dict[str, str]) -> Path:
    """A small tree under `root`: a base of empty role packages and one plugin, plus
    `files` (relative path -> source)."""
    base = {
        "kibotos/__init__.py": "",
        "kibotos/core/errors.py": "",
        "kibotos/sdk/__init__.py": "from kibotos.core import errors\n",
        "kibotos/ctrl/__init__.py": "",
        "kibotos/ctrl/model/__init__.py": "",
        "kibotos/ctrl/model/rules.py": "from kibotos.core import errors\n",
        "kibotos/ctrl/live/__init__.py": "",
        "kibotos/ctrl/live/service.py": "import trio\n\nfrom kibotos.ctrl.model import rules\n",
        "kibotos/node/__init__.py": "",
        "kibotos/node/serve.py": "from kibotos.dataplane.process import control\n",
        "kibotos/dataplane/__init__.py": "",
        "kibotos/dataplane/process/__init__.py": "",
        "kibotos/dataplane/process/control.py": "",
        "kibotos/dataplane/process/serve.py": "",
        "plugins/acme/pyproject.toml": '[project]\nname = "kibotos-builtin-acme"\n'
                                       'dependencies = ["kibotos"]\n',
        "plugins/acme/kibotos_acme/__init__.py": "from kibotos.sdk import errors\n",
        "plugins/other/pyproject.toml": '[project]\nname = "kibotos-builtin-other"\n',
        "plugins/other/kibotos_other/__init__.py": "",
    }
    for rel, text in {**base, **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_planted_base_breaks_no_rule(tmp_path: Path) -> None:
    root = plant(tmp_path, {})
    assert role_violations(root) == shared_violations(root) == plugin_violations(root) == []
    assert trio_violations(root) == size_violations(root) == []
    assert import_cycles(root) == layer_violations(root) == set()


@pytest.mark.parametrize(("rel", "source", "expected"), [
    ("kibotos/ctrl/live/peek.py", "from kibotos.node import serve\n",
     "kibotos/ctrl/live/peek.py:1 imports kibotos.node.serve (kibotos.ctrl never imports "
     "kibotos.node)"),
    ("kibotos/node/peek.py", "if TYPE_CHECKING:\n    from kibotos.ctrl.live.service import X\n",
     "kibotos/node/peek.py:2 imports kibotos.ctrl.live.service (kibotos.node never imports "
     "kibotos.ctrl)"),
    ("kibotos/node/peek.py", "def f():\n    from kibotos.dataplane.process.serve import main\n",
     "kibotos/node/peek.py:2 imports kibotos.dataplane.process.serve (kibotos.node never imports "
     "kibotos.dataplane)"),
    ("kibotos/dataplane/peek.py", "import kibotos.node.serve\n",
     "kibotos/dataplane/peek.py:1 imports kibotos.node.serve (kibotos.dataplane never "
     "imports kibotos.node)"),
])
def test_a_planted_role_import_is_reported(tmp_path: Path, rel: str, source: str,
                                           expected: str) -> None:
    assert role_violations(plant(tmp_path, {rel: source})) == [expected]


def test_a_planted_shared_import_of_a_role_is_reported(tmp_path: Path) -> None:
    root = plant(tmp_path, {"kibotos/config.py": "def url():\n    from kibotos.ctrl import "
                                                 "model\n",
                            "kibotos/cli/main.py": "from kibotos.node import serve\n"})
    assert shared_violations(root) == [
        "kibotos/config.py:2 imports kibotos.ctrl.model (shared modules import no role: "
        "kibotos.ctrl)"]  # the CLI, an entry point, may


@pytest.mark.parametrize(("source", "expected"), [
    ("from kibotos.core.errors import InvalidArgument\n",
     "plugins/acme/kibotos_acme/driver.py:1 imports kibotos.core.errors (plugins import kibotos "
     "only through kibotos.sdk)"),
    ("from kibotos_other import thing\n",
     "plugins/acme/kibotos_acme/driver.py:1 imports kibotos_other (a plugin imports another "
     "only when its pyproject.toml declares kibotos-builtin-other)"),
])
def test_a_planted_plugin_import_is_reported(tmp_path: Path, source: str,
                                             expected: str) -> None:
    root = plant(tmp_path, {"plugins/acme/kibotos_acme/driver.py": source})
    assert plugin_violations(root) == [expected]
    declared = plant(tmp_path, {"plugins/acme/pyproject.toml": (
        '[project]\nname = "kibotos-builtin-acme"\n'
        'dependencies = ["kibotos", "kibotos-builtin-other"]\n')})
    assert len(plugin_violations(declared)) == (0 if "kibotos_other" in source else 1)


def test_trio_planted_behind_a_synchronous_module_is_reported(tmp_path: Path) -> None:
    root = plant(tmp_path, {"kibotos/ctrl/store/__init__.py": "",
                            "kibotos/ctrl/store/watch.py": "import trio.lowlevel\n",
                            "kibotos/ctrl/model/placement.py":
                                "from kibotos.ctrl.store.watch import Change\n"})
    assert trio_violations(root) == [
        "kibotos.ctrl.model.placement imports trio: kibotos.ctrl.model.placement -> "
        "kibotos.ctrl.store.watch (kibotos/ctrl/store/watch.py:1 imports trio.lowlevel)"]
    in_a_parent = plant(tmp_path / "p", {"kibotos/ctrl/__init__.py": "import trio\n"})
    assert any(v.startswith("kibotos.ctrl.model.rules imports trio: kibotos.ctrl.model.rules "
                            "-> kibotos.ctrl") for v in trio_violations(in_a_parent))


def test_a_planted_cycle_is_reported_and_type_checking_imports_only_when_asked(
        tmp_path: Path) -> None:
    root = plant(tmp_path, {
        "kibotos/node/a.py": "def f():\n    from kibotos.node import b\n",
        "kibotos/node/b.py": "from kibotos.node.c import x\n",
        "kibotos/node/c.py": "import kibotos.node.a\n",
        "kibotos/node/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from kibotos.node.e import Y\n",
        "kibotos/node/e.py": "from kibotos.node import d\n",
        "kibotos/guest/kibotos_guest/__init__.py": "def main():\n    from . import cli\n",
        "kibotos/guest/kibotos_guest/cli.py": "from . import main\n",
    })
    assert import_cycles(root) == {("kibotos.node.a", "kibotos.node.b", "kibotos.node.c")}
    assert import_cycles(root, type_checking=True) == {
        ("kibotos.node.a", "kibotos.node.b", "kibotos.node.c"),
        ("kibotos.node.d", "kibotos.node.e")}


def test_a_planted_import_against_the_layer_order_is_reported(tmp_path: Path) -> None:
    root = plant(tmp_path, {
        "kibotos/ctrl/model/peek.py": "from kibotos.ctrl.live import service\n",
        "kibotos/ctrl/pools/__init__.py": "",
        "kibotos/ctrl/pools/same.py": "from kibotos.ctrl.model import rules\n",  # same layer
        "kibotos/ctrl/api/__init__.py": "",
        "kibotos/ctrl/api/up.py": "from kibotos.ctrl.model import rules\n",  # an earlier one
        "kibotos/node/host/__init__.py": "",
        "kibotos/node/host/peek.py": "if TYPE_CHECKING:\n    from kibotos.node import serve\n",
        "kibotos/node/elsewhere/__init__.py": "",
    })
    assert layer_violations(root) == {
        ("kibotos.ctrl.model.peek", "kibotos.ctrl.live.service"),
        ("kibotos.node.host.peek", "kibotos.node.serve"),
        ("kibotos.node.elsewhere", ""),  # a folder in no layer
    }


def test_a_planted_long_module_and_a_crowded_folder_are_reported(tmp_path: Path) -> None:
    crowd = [f"m{i:02}.py" for i in range(MAX_MODULES + 1)]
    root = plant(tmp_path, {
        **{f"kibotos/node/crowd/{m}": "" for m in crowd}, "kibotos/node/crowd/__init__.py": "",
        # Outside ctrl and the node too, and at any depth.
        **{f"kibotos/cli/crowd/{m}": "" for m in crowd},
        **{f"kibotos/dataplane/endpoints/{m}": "" for m in crowd},
        # The guest agent's package as well.
        **{f"kibotos/guest/kibotos_guest/services/{m}": "" for m in crowd},
        "kibotos/guest/kibotos_guest/long.py": "x = 1\n" * (MAX_LINES + 1),
        # Exactly at the limits is fine.
        **{f"kibotos/gateway/full/{m}": "" for m in crowd[:MAX_MODULES]},
        "kibotos/ctrl/long.py": "x = 1\n" * (MAX_LINES + 1),
        "kibotos/ctrl/ok.py": "x = 1\n" * MAX_LINES})
    assert size_violations(root) == [
        "kibotos/ctrl/long.py has 601 lines (at most 600)",
        "kibotos/guest/kibotos_guest/long.py has 601 lines (at most 600)",
        "kibotos/cli/crowd has 16 modules (at most 15)",
        "kibotos/dataplane/endpoints has 16 modules (at most 15)",
        "kibotos/guest/kibotos_guest/services has 16 modules (at most 15)",
        "kibotos/node/crowd has 16 modules (at most 15)"]
