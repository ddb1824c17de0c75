"""The dev cluster's process handling and file layout, with real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kibotos import config
from kibotos.dev import layout as lay
from kibotos.dev.procs import Service, Supervisor, is_ours, read_pid, tail
from kibotos.testing.waiting import wait_until_sync

# A stand-in service: a Python that sleeps, with `serve` and a config path in its argv
# like `kibotos node serve --config X`; `ignore_term` makes it shrug off SIGTERM.
_SLEEPER = """
import signal, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("sleeper " + "started", flush=True)
time.sleep(600)
"""


def _service(tmp_path: Path, name: str = "svc", ignore_term: bool = False) -> Service:
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text("")
    argv = (sys.executable, "-c", _SLEEPER, "ignore" if ignore_term else "term",
            "serve", "--config", str(cfg))
    return Service(name, argv, cfg, tmp_path / f"{name}.log", tmp_path / f"{name}.pid")


def test_start_writes_pid_and_log_and_stop_removes_pid(tmp_path):
    sup = Supervisor()
    svc = _service(tmp_path)
    pid = sup.start(svc)
    assert read_pid(svc.pid_file) == pid
    assert sup.pid(svc) == pid
    wait_until_sync(lambda: "sleeper started" in svc.log.read_text(),
                    "the service's output in its log")
    assert os.getsid(pid) == pid  # its own session: a Ctrl-C of the starter misses it
    assert sup.stop([svc], grace=30.0) == ["svc"]
    assert sup.pid(svc) is None
    assert not svc.pid_file.exists()
    assert sup.exit_status("svc") == -signal.SIGTERM


def test_stop_escalates_to_sigkill(tmp_path):
    sup = Supervisor()
    svc = _service(tmp_path, ignore_term=True)
    sup.start(svc)
    wait_until_sync(lambda: "sleeper started" in svc.log.read_text(),
                    "the SIGTERM handler to be set")
    assert sup.stop([svc], grace=0.5) == ["svc"]
    assert sup.exit_status("svc") == -signal.SIGKILL


def test_stop_ends_a_stopped_process(tmp_path):
    sup = Supervisor()
    svc = _service(tmp_path)
    pid = sup.start(svc)
    os.kill(pid, signal.SIGSTOP)
    assert sup.stop([svc], grace=30.0) == ["svc"]
    assert sup.exit_status("svc") == -signal.SIGTERM


def test_a_reused_pid_is_never_signalled(tmp_path):
    """The PID file names a live process that is not the service: leave it alone."""
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        svc = _service(tmp_path)
        svc.pid_file.write_text(f"{stranger.pid}\n")
        sup = Supervisor()  # a fresh supervisor, as in `kibotos dev cluster down`
        assert not is_ours(stranger.pid, svc)
        assert sup.pid(svc) is None
        assert sup.signal(svc, signal.SIGKILL) is None
        assert sup.stop([svc], grace=0.1) == []
        assert stranger.poll() is None  # still alive
        assert not svc.pid_file.exists()  # the stale file is cleared
    finally:
        stranger.kill()
        stranger.wait()


def test_another_supervisor_finds_and_stops_a_service(tmp_path):
    """`up` and `down` are different processes: the PID file and /proc are enough."""
    starter = Supervisor()
    svc = _service(tmp_path)
    pid = starter.start(svc)
    other = Supervisor()
    assert other.pid(svc) == pid
    assert other.stop([svc], grace=30.0) == ["svc"]
    assert starter.wait_exit(svc, pid, 30.0)  # its parent reaps it
    assert starter.exit_status("svc") == -signal.SIGTERM


def test_garbage_pid_file_and_tail(tmp_path):
    svc = _service(tmp_path)
    svc.pid_file.write_text("not a pid\n")
    assert read_pid(svc.pid_file) is None
    assert Supervisor().pid(svc) is None
    assert "does not exist" in tail(tmp_path / "missing.log")
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert tail(log, 3) == "line 97\nline 98\nline 99"


def test_configs_written_are_valid_and_complete(tmp_path):
    layout = lay.Layout(tmp_path)
    lay.write_ctrl_config(layout, listen="127.0.0.1:0", reconcile_interval="2s",
                          session_timeout="5s")
    ctrl = config.load(config.CtrlConfig, layout.ctrl_config)
    assert ctrl.ctrl.listen == "127.0.0.1:0"
    assert ctrl.ctrl.state_dir == layout.ctrl_state
    assert ctrl.ctrl.reconcile_interval == 2.0
    assert ctrl.ctrl.session_timeout == 5.0

    lay.write_node_config(layout, "node-1", ctrl_url="http://127.0.0.1:1", cpu="2.5",
                          memory="4G", shared_pool=True, test_inputs=True)
    node = config.load(config.NodeConfig, layout.node_config("node-1"))
    d = layout.node_dir("node-1")
    assert node.node.enrollment_grant_file == d / "grant"
    # d / "root", or (tmp_path is long) a short link to it that keeps the Instance
    # sockets under it within sun_path
    assert node.storage.root == lay.storage_root(d)
    assert node.storage.root.resolve() == (d / "root").resolve()
    assert len(str(node.storage.root)) + lay.INSTANCE_SOCKET_TAIL <= 107
    if node.storage.root.is_symlink():
        node.storage.root.unlink()
    assert [(p.id, p.path, p.default, p.shared) for p in node.storage.pool] == [
        ("node-1", d / "pool", True, False),
        ("shared", tmp_path / "shared-pool", False, True),
    ]
    assert all(p.path.is_dir() for p in node.storage.pool)
    assert node.resources.cpu_millis == 2500
    assert node.resources.memory_bytes == 4 * 2**30
    assert node.host.proc_root == d / "proc"
    assert node.testing.clock_skew_file == d / "clock-skew"
    assert (d / "clock-skew").read_text().strip() == "0"
    assert layout.node_ids() == ["node-1"]


def test_bad_resources_are_refused_before_anything_is_written(tmp_path):
    layout = lay.Layout(tmp_path)
    with pytest.raises(Exception, match="memory"):
        lay.write_node_config(layout, "node-1", ctrl_url="http://127.0.0.1:1", cpu="4",
                              memory="lots", shared_pool=False, test_inputs=False)
    assert not layout.node_config("node-1").exists()


def test_toml_writer_round_trips():
    doc = {"a": {"s": 'quote " and \\ and é', "n": 3, "f": 2.5, "b": True,
                 "l": ["x", "y"], "t": [{"id": "p1"}, {"id": "p2"}]}}
    assert tomllib.loads(lay.to_toml(doc, "header\nline")) == doc


def test_write_meminfo_keeps_other_lines(tmp_path):
    lay.prepare_proc_root(tmp_path)
    before = (tmp_path / "meminfo").read_text().splitlines()
    lay.write_meminfo(tmp_path, total_bytes=8 * 2**30, available_bytes=2**29)
    after = (tmp_path / "meminfo").read_text().splitlines()
    assert len(after) == len(before)
    values = {k: v.split()[0] for k, v in (line.split(":", 1) for line in after)}
    assert values["MemTotal"] == str(8 * 2**20)
    assert values["MemAvailable"] == str(2**19)
