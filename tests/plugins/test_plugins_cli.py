"""``kibotos plugins list``: the table, ``--json``, the block list from a role's config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from kibotos.cli.main import kibotos_cli
from kibotos.plugins import DISABLE_ENV, EXTRA_MODULES_ENV

NODE_TOML = """
[node]
id = "node-a"
ctrl_url = "http://127.0.0.1:7400"
[storage]
root = "/var/lib/kibotos/node"
[resources]
cpu = 2
memory = "4G"
[plugins]
disable = ["direct"]
"""


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    runner = CliRunner()
    full_env = {"COLUMNS": "200", "KIBO_ASCII": "1", **(env or {})}
    return runner.invoke(kibotos_cli, ["plugins", "list", *args], env=full_env,
                         catch_exceptions=False)


def rows(output: str) -> list[list[str]]:
    """The data rows of the ASCII tables, as lists of cells."""
    found = []
    for line in output.splitlines():
        if line.startswith("|") and not line.startswith("|-"):
            found.append([cell.strip() for cell in line.strip("|").split("|")])
    return found


def test_table_lists_the_builtins():
    result = run()
    assert result.exit_code == 0, result.output
    table = rows(result.stdout)
    assert table[0] == ["KIND", "NAME", "PLUGIN", "VERSION", "SOURCE"]
    assert ["placement", "binpack", "binpack", "0.1.0.dev0", "builtin"] in table
    assert ["placement", "spread", "spread", "0.1.0.dev0", "builtin"] in table
    assert ["storage-driver", "local", "local", "0.1.0.dev0", "builtin"] in table
    assert ["supervisor", "direct", "direct", "0.1.0.dev0", "builtin"] in table
    assert "BLOCKED" not in result.stdout


def test_json_shape():
    result = run("--json")
    assert result.exit_code == 0
    body = json.loads(result.stdout)
    assert set(body) == {"result"}
    assert set(body["result"]) == {"plugins", "blocked"}
    assert body["result"]["blocked"] == []
    assert {
        "kind": "storage_driver", "name": "local", "plugin": "local",
        "version": "0.1.0.dev0", "source": "builtin", "module": "kibotos_local.driver",
    } in body["result"]["plugins"]
    kinds_names = [(p["kind"], p["name"]) for p in body["result"]["plugins"]]
    assert kinds_names == sorted(kinds_names)


def test_ctrl_config_block_list(tmp_path: Path):
    ctrl = tmp_path / "ctrl.toml"
    ctrl.write_text('[ctrl]\nplacement_policy = "binpack"\n[plugins]\ndisable = ["spread"]\n')
    result = run("--config", str(ctrl))
    assert result.exit_code == 0
    table = rows(result.stdout)
    assert not any(r[:2] == ["placement", "spread"] for r in table)
    assert ["BLOCKED", "SOURCE", "MODULE"] in table
    assert ["spread", "builtin", "kibotos_spread"] in table
    body = json.loads(run("--config", str(ctrl), "--json").stdout)
    assert body["result"]["blocked"] == [
        {"plugin": "spread", "source": "builtin", "module": "kibotos_spread"}
    ]


def test_node_config_and_environment_block_lists_add_up(tmp_path: Path):
    node = tmp_path / "node.toml"
    node.write_text(NODE_TOML)
    result = run("--config", str(node), "--json", env={DISABLE_ENV: "local,typo"})
    assert result.exit_code == 0
    blocked = json.loads(result.stdout)["result"]["blocked"]
    assert blocked == [
        {"plugin": "direct", "source": "builtin", "module": "kibotos_direct"},
        {"plugin": "local", "source": "builtin", "module": "kibotos_local"},
        {"plugin": "typo", "source": "not-installed", "module": None},
    ]
    table = rows(run("--config", str(node), env={DISABLE_ENV: "typo"}).stdout)
    assert ["typo", "not-installed", "-"] in table


def test_test_plugins_show_their_source():
    result = run(env={EXTRA_MODULES_ENV: "plugintest_allkinds"})
    assert result.exit_code == 0
    table = rows(result.stdout)
    assert ["vmm", "test-echo", "plugintest_allkinds", "test", "test"] in table
    assert ["supervisor", "test-null", "plugintest_allkinds", "test", "test"] in table


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("[plugins]\ndisable = 'spread'\n", "plugins.disable: Input should be a valid list"),
        ("[plugins]\nblock = []\n", "plugins.block: unknown key"),
        ("[plugins\n", "is not valid TOML"),
    ],
)
def test_bad_config_exits_10_naming_the_problem(tmp_path: Path, content: str, expected: str):
    path = tmp_path / "ctrl.toml"
    path.write_text(content)
    result = run("--config", str(path))
    assert result.exit_code == 10
    assert result.stdout == ""
    assert expected in result.stderr
    assert result.stderr.startswith("error: invalid_argument: ")


def test_missing_config_file(tmp_path: Path):
    result = run("--config", str(tmp_path / "nope.toml"), "--json")
    assert result.exit_code == 10
    assert json.loads(result.stdout)["error"]["code"] == "invalid_argument"
    assert "does not exist" in result.stderr


def test_duplicate_backend_fails_with_exit_13(tmp_path: Path, monkeypatch):
    module = tmp_path / "plugintest_cli_dup.py"
    module.write_text(
        "from kibotos.sdk import hookimpl\n"
        "class Dup:\n"
        "    name = 'local'\n"
        "    def __init__(self, options): pass\n"
        "    def check(self, pool, host): pass\n"
        "@hookimpl\n"
        "def kibotos_register_storage_driver(register):\n"
        "    register(Dup)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    result = run("--json", env={EXTRA_MODULES_ENV: "plugintest_cli_dup"})
    assert result.exit_code == 13
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "failed_precondition"
    assert error["message"] == (
        "duplicate storage driver backend 'local': kibotos_local.driver and plugintest_cli_dup"
    )
