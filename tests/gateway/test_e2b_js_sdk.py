"""The E2B JavaScript SDK (npm ``e2b@2.51.0``, under Debian's nodejs) runs the basic
script against the gateway: create, run (output and CommandExitError), write, read,
kill.  The package comes from the test cache (``make e2b-js-sdk`` installs it with npm;
tests never fetch anything); without node or the package the test is skipped, or fails
under CI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from gateway_proc import E2bSetup

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("e2b_basic.mjs")


def _node_modules() -> Path:
    cache = Path(os.environ.get("KIBOTOS_TEST_CACHE", "/var/cache/kibotos-test"))
    modules = cache / "e2b-js" / "node_modules"
    missing = []
    if shutil.which("node") is None:
        missing.append("node (Debian's nodejs)")
    if not (modules / "e2b" / "package.json").exists():
        missing.append(f"{modules}/e2b (make e2b-js-sdk)")
    if missing:
        message = f"the JS SDK test needs {', '.join(missing)}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return modules


def test_the_js_sdk_creates_runs_writes_reads_and_kills(e2b: E2bSetup,
                                                         tmp_path: Path) -> None:
    modules = _node_modules()
    script = tmp_path / SCRIPT.name  # ESM resolves 'e2b' from the script's directory
    script.write_text(SCRIPT.read_text())
    (tmp_path / "node_modules").symlink_to(modules)
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(E2B_API_KEY=e2b.key, E2B_API_URL=e2b.gateway.api_url,
               E2B_SANDBOX_URL=e2b.gateway.sandbox_url)
    done = subprocess.run(["node", str(script)], env=env, capture_output=True, text=True,
                          timeout=300, check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"stdout": "hello js\n", "stderr": "err\n",
                                       "exitCode": 4, "read": "written by js",
                                       "killed": True}
