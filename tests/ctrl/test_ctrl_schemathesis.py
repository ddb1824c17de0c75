"""schemathesis against a real ctrl (`serve_ctrl`: hypercorn on 127.0.0.1 over HTTPS,
its certificate verified against the cluster CA, its live services running), driven by
the document ctrl serves: every operation, positive and negative cases, with every check
schemathesis runs by default (no 5xx, statuses, content types, headers and bodies as documented,
bad input refused, good input accepted, 405 with ``Allow``, auth required).  It must
report no failure.  Bounded in examples and time so the run costs about two minutes of
CI; ``st`` runs as a process of its own, so ctrl's event loop keeps serving while it
works.

What schemathesis cannot judge is configured in `CONFIG`, each with its reason: the
session endpoint (a WebSocket upgrade, tested in test_ctrl_session), and the operations
whose valid input has a rule JSON Schema cannot state (two fields that go together, a
confirmation that must be true, an opaque page token, a body that must hash to its URL):
for those only the "schema-valid input is accepted" check is off, every other check
stays.  A 412 (``failed_precondition``: an object's state, such as blobs not uploaded
yet) is an answer to valid input, as schemathesis already takes 404 and 409."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from ctrl_helpers import enroll_operator, make_config

from kibotos.ctrl.serve import open_store, serve_ctrl
from kibotos.tls.local_ctrl import ca_file, client_tls, ctrl_url

pytestmark = pytest.mark.slow

ST = Path(sys.executable).with_name("st")

#: Operations whose schema-valid input can still be invalid, and why.
CROSS_FIELD_RULES = {
    "POST /v1/enrollment/grants": "node_id goes with kind node, and only with it",
    "POST /v1/enrollment/revoke": "the ID must name a grant or an identity",
    "POST /v1/api-keys/verify": "a key is kak-<id>.<secret>",
    "PUT /v1/overcommit/default": "cpu, memory or both",
    "PUT /v1/nodes/{node_id}/overcommit": "cpu, memory or both",
    "POST /v1/nodes/{node_id}/isolate": "confirm_host_cannot_write must be true",
    "POST /v1/storage-pools/{pool_id}/declare-lost": "confirm_data_lost must be true",
    "GET /v1/workspace-locations": "exactly one of node_id and instance_id",
    "POST /v1/enrollment/exchange": "public_key must be an Ed25519 public key",
    "POST /v1/egresses": "username and password together; address is HOST:PORT",
    "POST /v1/resolvers": "upstream is an address or host name, with a port or not",
    "POST /v1/workspaces": "allow_out and deny_out are lists of CIDRs",
    "POST /v1/workspaces/{workspace_id}/set-network": "allow_out and deny_out are CIDRs",
    "POST /v1/egresses/{name}/update": "address, credentials or clear_credentials",
    "PUT /v1/artifacts/sha256/{hex}": "the body must hash to the digest in the URL",
    "GET /v1/nodes": "page_token is opaque: only a next_page_token is one",
    "GET /v1/workspaces": "page_token is opaque: only a next_page_token is one",
    "GET /v1/volumes": "page_token is opaque: only a next_page_token is one",
}


#: schemathesis' defaults, with 412 for valid input and 413 for invalid input (a body
#: over the route's limit is refused before it is read, so it is never judged further).
ACCEPTED = ["2XX", "3XX", "401", "403", "404", "409", "412", "429", "5XX"]
REJECTED = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428",
            "429", "5XX"]


def config_text() -> str:
    """schemathesis.toml: the statuses above, and `CROSS_FIELD_RULES`' exceptions."""
    lines = ["[checks.positive_data_acceptance]", f"expected-statuses = {ACCEPTED}",
             "[checks.negative_data_rejection]", f"expected-statuses = {REJECTED}", ""]
    for name, reason in CROSS_FIELD_RULES.items():
        method, path = name.split(" ")
        for each in ((method, "HEAD") if method == "GET" else (method,)):
            lines += [f"# {reason}", "[[operations]]",
                      f'include-name = "{each} {path}"',
                      "checks.positive_data_acceptance.enabled = false", ""]
    return "\n".join(lines)


@dataclass
class Ctrl:
    url: str
    ca: Path
    operator: dict[str, str]


@pytest.fixture
async def served_ctrl(tmp_path: Path) -> AsyncIterator[Ctrl]:
    config = make_config(tmp_path)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(partial(serve_ctrl, config, handle_signals=False))
        url = ctrl_url(config, address)
        ca = ca_file(config)
        assert ca is not None  # the issued certificate: verified against the cluster CA
        store = await open_store(config)
        try:
            async with httpx.AsyncClient(base_url=url, verify=client_tls(config)) as http:
                operator = await enroll_operator(http, store)
        finally:
            store.close()
        yield Ctrl(url=url, ca=ca, operator=operator)
        nursery.cancel_scope.cancel()


def junit_counts(report_dir: Path) -> dict[str, int]:
    """The operations tested and the failures and errors schemathesis found, from its
    JUnit report (one test case per operation)."""
    counts = {"tests": 0, "failures": 0, "errors": 0}
    for report in report_dir.glob("*.xml"):
        for suite in ET.parse(report).getroot().iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, "0"))
    return counts


async def run_schemathesis(ctrl: Ctrl, tmp_path: Path, *options: str) -> str:
    """``st run`` against `ctrl`'s served document with `config_text`; its output,
    asserted free of failures by the exit status and the JUnit report."""
    (tmp_path / "schemathesis.toml").write_text(config_text())
    done = await trio.run_process(
        [str(ST), "--config-file", str(tmp_path / "schemathesis.toml"), "run",
         f"{ctrl.url}/v1/openapi.json", "--tls-verify", str(ctrl.ca),
         "--exclude-path", "/v1/node/session",
         "--request-timeout", "30", "--workers", "1", "--seed", "1",
         "--report", "junit", "--report-dir", str(tmp_path / "report"), *options],
        capture_stdout=True, stderr=subprocess.STDOUT, check=False, cwd=tmp_path)
    output = done.stdout.decode(errors="replace")
    assert done.returncode == 0, output
    counts = junit_counts(tmp_path / "report")
    assert counts["tests"] >= 90, (counts, output)  # every operation but the session's
    assert counts["failures"] == counts["errors"] == 0, (counts, output)
    return output


async def test_schemathesis_as_an_operator(served_ctrl: Ctrl, tmp_path: Path) -> None:
    output = await run_schemathesis(
        served_ctrl, tmp_path, "--header",
        f"Authorization: {served_ctrl.operator['Authorization']}",
        "--phases", "examples,coverage,fuzzing", "--max-examples", "20", "--max-time", "100")
    assert " passed" in output, output


@pytest.mark.parametrize("authorization", [
    None,  # no credential
    "Bearer kid-01m8te70zkx6wavk7rgb6jxse8:not-the-secret",  # an unknown identity
    "Bearer garbage",  # not the shape of a credential
    "Basic dXNlcjpwYXNz",  # another scheme
])
async def test_schemathesis_without_a_valid_credential(served_ctrl: Ctrl, tmp_path: Path,
                                                       authorization: str | None) -> None:
    """Every operation but the public ones answers 401 in the envelope, whatever else
    is wrong with the request; the public ones are judged as for an operator."""
    header = () if authorization is None else ("--header", f"Authorization: {authorization}")
    output = await run_schemathesis(
        served_ctrl, tmp_path, *header, "--phases", "coverage,fuzzing",
        "--max-examples", "3", "--max-time", "15")
    assert " passed" in output, output
