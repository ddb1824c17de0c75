"""Processes the agent starts (``exec``), signals, pty sizes, and the managed set.

Every process starts in a new session; those sessions, their descendants and the
orphans handed to the agent are the *managed processes* that ``stop_prepare`` ends.
`subprocess`, `pwd` and the tty modules are imported on the first ``exec``: a guest
that boots and is only configured never pays for them, and none is on the way to the
first hello.
"""

from __future__ import annotations

import os
import signal
import struct

from ..errors import AgentError, field, int_field, invalid, user_field
from ..log import log
from ..runtime.framing import DEFAULT_WINDOW, MAX_WINDOW
from ..runtime.streams import InputStream, OutputStream
from ..runtime.sysio import PR_SET_CHILD_SUBREAPER, libc_call

TYPE_CHECKING = False
if TYPE_CHECKING:
    import pwd
    import subprocess
    from typing import Any

    from ..core import Agent
    from ..runtime.channel import Channel

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ENV_KEY_FIRST = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_")
_ENV_KEY_REST = _ENV_KEY_FIRST | frozenset("0123456789")
_subreaper_done = False


def env_key_ok(key: str) -> bool:
    """A shell variable name: ``[A-Za-z_][A-Za-z0-9_]*``."""
    return bool(key) and key[0] in _ENV_KEY_FIRST and all(c in _ENV_KEY_REST for c in key)


class ManagedProcess:
    """A process the agent started: its session is ended by stop_prepare."""

    def __init__(self, process_id: int, pid: int, argv: list[str],
                 popen: subprocess.Popen[bytes], channel: Channel | None, session: int,
                 on_detach: str, master_fd: int = -1) -> None:
        self.process_id = process_id
        self.pid = pid
        self.argv = argv
        self.popen = popen
        self.channel = channel
        self.session = session
        self.on_detach = on_detach
        self.master_fd = master_fd
        self.exited = False


def become_subreaper() -> None:
    """Orphans of the processes we start come back to us, so we can reap and end them.
    Done once, before the first process starts (PID 1 gets orphans anyway)."""
    global _subreaper_done
    if _subreaper_done:
        return
    _subreaper_done = True
    if os.getpid() == 1:
        return
    try:
        libc_call("prctl", PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except OSError as e:
        log.warning("cannot become a child subreaper: %s", e)


def signal_number(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        if not 1 <= value < signal.NSIG:
            raise invalid(f"signal: no signal number {value}")
        return value
    if isinstance(value, str):
        name = value.upper() if value.upper().startswith("SIG") else "SIG" + value.upper()
        try:
            return int(signal.Signals[name])
        except KeyError:
            pass
    raise invalid(f"signal: unknown signal {value!r}")


def exit_fields(status: int) -> dict[str, Any]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"SIG{sig}"
        return {"exit_code": None, "signal": sig, "signal_name": name}
    return {"exit_code": os.WEXITSTATUS(status), "signal": None, "signal_name": None}


def members(agent: Agent) -> dict[int, str]:
    """Live processes of managed sessions and orphans handed to the agent: pid → name."""
    me = os.getpid()
    found: dict[int, str] = {}
    live: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                head, _, rest = f.read().rpartition(b")")
        except OSError:
            continue
        fields = rest.split()
        if fields[0] in (b"Z", b"X"):
            continue
        session = int(fields[3])
        if session in agent.sessions or int(fields[1]) == me:
            found[int(name)] = head.partition(b"(")[2].decode(errors="replace")
            live.add(session)
    agent.sessions = {s for s in agent.sessions if s in live or s in agent.by_pid}
    return found


def _lookup(agent: Agent, msg: dict[str, Any]) -> ManagedProcess:
    process_id = int_field(msg, "process", 1, 2**63)
    proc = agent.processes.get(process_id)
    if proc is None:
        raise AgentError("not_found", f"{msg['type']}: no running process {process_id}")
    return proc


def _identity(uid: int | None, gid: int | None, named: pwd.struct_passwd | None = None) -> (
    tuple[int | None, int | None, list[int] | None, pwd.struct_passwd | None]
):
    """uid, gid, supplementary groups and passwd entry of a process: a user asked for by
    name is that entry (another name may share its uid), a uid is looked up."""
    import pwd

    if named is not None:
        uid, gid = named.pw_uid, named.pw_gid
    try:
        pw: pwd.struct_passwd | None = named or pwd.getpwuid(
            os.geteuid() if uid is None else uid)
    except KeyError:
        pw = None
    if uid is None:
        return None, gid, None, pw
    if gid is None:
        gid = pw.pw_gid if pw is not None else uid
    groups = None
    if os.geteuid() == 0:  # never hand root's supplementary groups to another user
        groups = os.getgrouplist(pw.pw_name, gid) if pw is not None else [gid]
    return uid, gid, groups, pw


def _process_env(agent: Agent, overrides: dict[str, Any], pw: pwd.struct_passwd | None,
                 use_tty: bool) -> dict[str, str]:
    env = {"PATH": DEFAULT_PATH, "HOME": pw.pw_dir if pw is not None else "/"}
    if pw is not None:
        env.update(USER=pw.pw_name, LOGNAME=pw.pw_name, SHELL=pw.pw_shell or "/bin/sh")
    if use_tty:
        env["TERM"] = "xterm-256color"
    env.update(agent.env_defaults)
    for key, value in overrides.items():
        if not env_key_ok(key) or not (value is None or isinstance(value, str)):
            raise invalid(f"exec: bad environment entry {key!r}")
        if value is None:
            env.pop(key, None)
        elif "\0" in value:
            raise invalid(f"exec: environment value of {key!r} contains NUL")
        else:
            env[key] = value
    return env


def _acquire_ctty() -> None:  # runs in the child, after setsid, before exec
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def exec_request(agent: Agent, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
    if agent.stopping:
        raise AgentError("failed_precondition", "exec: the guest is prepared for stop "
                         "and its file systems are frozen; send thaw first")
    argv = field(msg, "argv", list)
    if not argv or not all(isinstance(a, str) and "\0" not in a for a in argv):
        raise invalid("exec: 'argv' must be a non-empty list of strings")
    use_tty = field(msg, "tty", bool, False)
    rows, cols = int_field(msg, "rows", 1, 65535, 24), int_field(msg, "cols", 1, 65535, 80)
    window = int_field(msg, "window", 1, MAX_WINDOW, DEFAULT_WINDOW)
    on_detach = field(msg, "on_detach", str, "hangup")
    if on_detach not in ("hangup", "keep"):
        raise invalid("exec: 'on_detach' must be 'hangup' or 'keep'")
    ids = {n: int_field(msg, f"{n}_stream", 1, 2**32 - 1, None)
           for n in ("stdin", "stdout", "stderr")}
    used = [i for i in ids.values() if i is not None]
    if len(set(used)) != len(used) or any(i in ch.streams for i in used):
        raise invalid("exec: stream ids must be distinct and not already open")
    if use_tty and (ids["stderr"] is not None or ids["stdout"] is None):
        raise invalid("exec: a tty process has one output stream: give 'stdout_stream' only")
    named = user_field(msg)  # a name: its uid, gid, groups, HOME and USER, as a login
    uid, gid, groups, pw = _identity(int_field(msg, "uid", 0, 2**32 - 2, None),
                                     int_field(msg, "gid", 0, 2**32 - 2, None), named)
    env = _process_env(agent, field(msg, "env", dict, {}), pw, use_tty)
    cwd = field(msg, "cwd", str, None)
    if cwd is None:
        cwd = env["HOME"] if os.path.isdir(env["HOME"]) else "/"

    import subprocess

    become_subreaper()
    child_fds: list[int] = []
    parent: dict[str, int] = {}
    master = -1
    std: dict[str, int] = dict.fromkeys(ids, subprocess.DEVNULL)
    try:
        if use_tty:
            import fcntl
            import termios

            master, slave = os.openpty()
            child_fds.append(slave)
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
            std = dict.fromkeys(ids, slave)
        else:
            for n, sid in ids.items():
                if sid is not None:
                    r, w = os.pipe2(os.O_CLOEXEC)
                    child, mine = (r, w) if n == "stdin" else (w, r)
                    child_fds.append(child)
                    parent[n] = mine
                    std[n] = child
        popen = subprocess.Popen(
            argv, stdin=std["stdin"], stdout=std["stdout"], stderr=std["stderr"], cwd=cwd,
            env=env, start_new_session=True, user=uid, group=gid, extra_groups=groups,
            preexec_fn=_acquire_ctty if use_tty else None,
        )
    except Exception as e:
        for fd in [*parent.values(), *([master] if master >= 0 else [])]:
            os.close(fd)
        if isinstance(e, FileNotFoundError):
            raise AgentError("not_found", f"exec: {e.filename or argv[0]}: "
                             "no such file or directory") from None
        if isinstance(e, PermissionError):
            raise AgentError("permission_denied", f"exec: {argv[0]}: {e.strerror}") from None
        if isinstance(e, OSError):
            raise AgentError("failed_precondition", f"exec: {argv[0]}: {e}") from None
        raise
    finally:
        for fd in child_fds:
            os.close(fd)

    agent.next_process += 1
    proc = ManagedProcess(agent.next_process, popen.pid, list(argv), popen, ch, ch.session,
                          on_detach, master)
    agent.processes[proc.process_id] = proc
    agent.by_pid[proc.pid] = proc
    agent.sessions.add(proc.pid)
    if use_tty:
        parent = {"stdout": os.dup(master)}
        if ids["stdin"] is not None:
            parent["stdin"] = os.dup(master)
    for n, fd in parent.items():
        sid = ids[n]
        assert sid is not None
        stream: InputStream | OutputStream
        if n == "stdin":
            stream = InputStream(ch, sid, fd, DEFAULT_WINDOW, use_tty)
        else:
            stream = OutputStream(ch, sid, fd, window, proc)
            stream.start()  # its first frame can only follow this response
        ch.streams[sid] = stream
    return {"process": proc.process_id, "pid": proc.pid, "stdin_window": DEFAULT_WINDOW}


def signal_request(agent: Agent, msg: dict[str, Any]) -> dict[str, Any]:
    proc = _lookup(agent, msg)
    sig = signal_number(msg.get("signal"))
    try:
        if field(msg, "group", bool, False):
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
    except ProcessLookupError:
        raise AgentError("not_found", f"signal: process {proc.process_id} is gone") from None
    return {}


def resize_request(agent: Agent, msg: dict[str, Any]) -> dict[str, Any]:
    proc = _lookup(agent, msg)
    rows, cols = int_field(msg, "rows", 1, 65535), int_field(msg, "cols", 1, 65535)
    if proc.master_fd < 0:
        raise AgentError("failed_precondition", f"resize: process {proc.process_id} has no tty")
    import fcntl
    import termios

    fcntl.ioctl(proc.master_fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    return {}
