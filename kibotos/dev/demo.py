"""The steps of `make demo` after the apt packages and the venv: a cluster with its two
gateways, a Template, a Workspace booted in a real microVM, a command run in it with
``kibo``, and the same microVM used through the official E2B SDK (`demo_sdk`).

``packaging/demo.sh`` installs what the machine lacks, builds the venv and then runs
``python -m kibotos.dev.demo``; ``tests/e2e/test_demo.py`` runs the same module, so CI
proves the README's first command keeps working.  Every step is what an operator would
type (``kibo template build``, ``kibo workspace create``, ``kibo workspace exec``, run as
real processes), and every step can be run again:

* a dev cluster that runs in DIR is reused; a stopped one is removed and started anew;
* the Template build is cached by its inputs (a rerun uploads nothing and leaves the
  Template ``unchanged``);
* a Workspace labelled ``purpose=demo`` (and ``e2b.team=default``, which makes it a
  sandbox of the dev cluster's API key) that is AVAILABLE is reused, a STOPPED one is
  started, otherwise a new one is created;
* the gateways of a reused cluster are reused; missing ones are started.

The command's output and the SDK script's lines are written to stdout and nothing else
is, so ``make demo 2>/dev/null`` prints just what ran in the guest; progress goes to
stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from kibotos.core import errors
from kibotos.dev.cluster import DevCluster, script

#: One node: the demo boots one Workspace, and on a small machine (two cores, QEMU under
#: TCG) every further node is one more node and data-plane process for nothing.
NODES = 1
TEMPLATE = "kibotos-base"
LABEL = "purpose=demo"
#: The dev cluster's API key is of team ``default``: this label makes the Workspace one
#: of its sandboxes (kibotos.gateway.common.sandbox_labels).
SANDBOX_LABEL = "e2b.team=default"
#: The guest's answer to "what am I?": its kernel, its Python, its distribution.
COMMAND = "uname -a; python3 --version; head -1 /etc/os-release"
#: A TCG boot takes 5-20 s here; a loaded machine can take minutes.
WAIT = "10m"


def say(msg: str) -> None:
    print(f"\n==> {msg}", file=sys.stderr, flush=True)


def ensure_cluster(cluster: DevCluster) -> None:
    """Reuse the cluster running in the directory, else start one with the qemu backend."""
    if cluster.layout.exists():
        states = cluster.status()
        if all(s.pid is not None for s in states):
            say(f"a dev cluster is already running in {cluster.dir}; reusing it")
            return
        say(f"removing the stopped dev cluster left in {cluster.dir}")
        cluster.down(grace=5.0)
        shutil.rmtree(cluster.dir)
    elif cluster.dir.exists() and any(cluster.dir.iterdir()):
        raise errors.FailedPrecondition(
            f"{cluster.dir} is not empty and holds no dev cluster; remove it or choose "
            "another --dir")
    say(f"starting ctrl and {NODES} node (VMM backend qemu) under {cluster.dir}")
    cluster.up(NODES, vmm_backend="qemu", log=lambda m: print(f"    {m}", file=sys.stderr))


def ensure_gateways(cluster: DevCluster) -> Path:
    """The E2B and Exposure gateways, started unless both run; DIR/e2b.env."""
    env_file = cluster.dir / "e2b.env"
    if len(cluster.gateway_services()) == 2 and env_file.exists():
        return env_file
    say("starting the E2B and Exposure gateways on loopback")
    urls = cluster.start_e2b_gateway()
    print(f"    E2B API {urls.api_url}, Exposure {urls.exposure_url}", file=sys.stderr)
    return urls.env_file


def kibo(cluster: DevCluster, *args: str, sudo: bool = False,
         capture: bool = False) -> subprocess.CompletedProcess[str]:
    """Run the real ``kibo`` against the cluster; its stdout goes to our stderr unless
    captured.  A failure raises `FailedPrecondition` naming the command."""
    config = f"KIBO_CONFIG={cluster.layout.kibo_config}"
    argv = [script("kibo"), *args]
    if sudo:
        if shutil.which("sudo") is None:
            raise errors.FailedPrecondition(f"`kibo {' '.join(args[:2])}` needs root: run "
                                            "as root or install sudo")
        argv = ["sudo", "env", config, *argv]  # sudo drops the environment
    done = subprocess.run(argv, text=True, stdin=subprocess.DEVNULL, check=False,
                          stdout=subprocess.PIPE if capture else sys.stderr,
                          env={**os.environ, "KIBO_CONFIG": config.split("=", 1)[1]})
    if done.returncode != 0:
        raise errors.FailedPrecondition(f"`kibo {' '.join(args)}` failed with exit code "
                                        f"{done.returncode} (its message is above)")
    return done


def build_template(cluster: DevCluster, recipe: Path, cache_dir: Path | None) -> None:
    """``kibo template build``: debootstrap needs root, so as another user through sudo
    (the build cache is then root's, /var/cache/kibotos, unless `cache_dir` is set)."""
    if not recipe.is_file():
        raise errors.InvalidArgument(f"recipe {recipe} is not a file")
    say(f"building and publishing the Template {TEMPLATE} (cached: a rerun takes seconds)")
    args = ["template", "build", TEMPLATE, "--recipe", str(recipe)]
    if cache_dir is not None:
        args += ["--cache-dir", str(cache_dir)]
    kibo(cluster, *args, sudo=os.geteuid() != 0)


def ensure_workspace(cluster: DevCluster) -> str:
    """The demo Workspace's ID: an AVAILABLE one, else a STOPPED one started, else a new
    one created from the Template (``create`` and ``start`` wait for AVAILABLE)."""
    found = _json(kibo(cluster, "workspace", "list", "--label", LABEL, "--label",
                       SANDBOX_LABEL, "--json", capture=True))["workspaces"]
    by_state: dict[str, list[str]] = {}
    for ws in found:
        by_state.setdefault(ws["state"], []).append(ws["workspace_id"])
    if by_state.get("AVAILABLE"):
        ws_id = by_state["AVAILABLE"][0]
        say(f"reusing the demo Workspace {ws_id} (AVAILABLE)")
        return ws_id
    if by_state.get("STOPPED"):
        ws_id = by_state["STOPPED"][0]
        say(f"starting the demo Workspace {ws_id} (STOPPED): a microVM boots")
        kibo(cluster, "workspace", "start", ws_id, "--timeout", WAIT)
        return ws_id
    say(f"creating a Workspace from {TEMPLATE}: a microVM boots (QEMU; about 15 s "
        "under TCG)")
    ws = _json(kibo(cluster, "workspace", "create", "--template", TEMPLATE, "--label",
                    LABEL, "--label", SANDBOX_LABEL, "--memory", "512M", "--timeout", WAIT,
                    "--json", capture=True))
    print(f"    workspace {ws['workspace_id']} {ws['state']} on {ws.get('node_id')}",
          file=sys.stderr)
    return str(ws["workspace_id"])


def run_in(cluster: DevCluster, ws_id: str, command: str = COMMAND) -> str:
    """Run `command` with ``sh -c`` in the Workspace; return its output."""
    say(f"kibo workspace exec {ws_id} -- sh -c '{command}'")
    return kibo(cluster, "workspace", "exec", ws_id, "--timeout", "5m", "--", "sh", "-c",
                command, capture=True).stdout


def run_sdk_script(env_file: Path, ws_id: str) -> str:
    """`demo_sdk` in a process of its own whose only E2B settings are DIR/e2b.env's (as
    ``set -a; . DIR/e2b.env`` gives a shell); its output."""
    settings = dict(line.split("=", 1) for line in env_file.read_text().splitlines()
                    if "=" in line)
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    sandbox_id = ws_id.removeprefix("ws-")
    say(f"the E2B SDK (set -a; . {env_file}): connect to sandbox {sandbox_id}, run, "
        "write, read, and get_host(8000) through the Exposure gateway")
    done = subprocess.run([sys.executable, "-m", "kibotos.dev.demo_sdk", sandbox_id],
                          env={**env, **settings}, stdin=subprocess.DEVNULL, text=True,
                          stdout=subprocess.PIPE, check=False, timeout=600)
    if done.returncode != 0:
        raise errors.FailedPrecondition(f"the E2B SDK script failed with exit code "
                                        f"{done.returncode} (its message is above); it "
                                        f"printed: {done.stdout.strip()!r}")
    return done.stdout


def _json(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    try:
        result = json.loads(done.stdout)["result"]
    except (ValueError, KeyError, TypeError):
        raise errors.Internal(f"kibo printed no JSON result: {done.stdout[:300]!r}") from None
    if not isinstance(result, dict):
        raise errors.Internal(f"kibo's result is not an object: {result!r}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kibotos.dev.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path(".dev-cluster"),
                   help="the dev cluster's directory (default .dev-cluster)")
    p.add_argument("--recipe", type=Path,
                   default=Path("packaging/template/kibotos-base.toml"),
                   help="the Template recipe (default packaging/template/kibotos-base.toml)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="the Template build cache (default: kibo's)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds for ctrl and the node to come up (default 120)")
    args = p.parse_args(argv)
    cluster = DevCluster(args.dir, timeout=args.timeout)
    try:
        ensure_cluster(cluster)
        env_file = ensure_gateways(cluster)
        build_template(cluster, args.recipe, args.cache_dir)
        ws_id = ensure_workspace(cluster)
        output = run_in(cluster, ws_id)
        output += run_sdk_script(env_file, ws_id)
    except errors.KibotosError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(output)
    sys.stdout.flush()
    print(f"\n(that ran in the microVM of Workspace {ws_id})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
