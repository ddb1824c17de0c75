"""The agent's command line and main loop.

    python3 agent.py [--port-name org.kibotos.agent.0] [--device PATH] [--socket PATH]
                     [--vsock PORT] [--fd N] [--root DIR]

The order of the start is chosen for a booting guest, where every import costs ten
times what it does on a host: arguments, the channel, the hello; everything else
(processes, configure, stop, ctypes, subprocess, threads) loads on first use.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time

from . import DEFAULT_PORT_NAME, PROTOCOL_VERSION
from .core import Agent
from .log import log
from .runtime.channel import Channel
from .runtime.loop import Loop, get_loop
from .runtime.tasks import Event
from .runtime.transport import find_port_device, listen, listen_vsock, wait_for_device

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable


class Options:
    """The parsed command line (what `argparse.Namespace` held before)."""

    def __init__(self) -> None:
        self.port_name: list[str] = []
        self.device: str | None = None
        self.socket: str | None = None
        self.vsock: int | None = None
        self.fd: int | None = None
        self.root = "/"
        self.sysfs = "/sys/class/virtio-ports"
        self.dev_dir = "/dev"
        self.advertise_protocol_version = PROTOCOL_VERSION
        self.log_level = "INFO"


_VALUED = {"--port-name": "port_name", "--device": "device", "--socket": "socket",
           "--vsock": "vsock", "--fd": "fd", "--root": "root", "--sysfs": "sysfs",
           "--dev-dir": "dev_dir",
           "--advertise-protocol-version": "advertise_protocol_version",
           "--log-level": "log_level"}
_INTEGERS = ("fd", "vsock", "advertise_protocol_version")
_EXCLUSIVE = ("device", "socket", "vsock", "fd")


def _parse_plain(argv: list[str]) -> Options | None:
    """The command lines the agent is started with (``--name value`` or ``--name=value``,
    each option spelled in full), parsed without argparse: importing argparse pulls in
    gettext, locale and shutil (and through it bz2 and lzma), a tenth of a second in a
    TCG guest.  None for anything else (help, abbreviations, errors): argparse then
    handles it, so its behaviour stays the reference."""
    opts = Options()
    exclusive: set[str] = set()
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        attr = _VALUED.get(name)
        if attr is None:
            return None
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                return None  # a missing value, or one argparse may read differently
            value = argv[i + 1]
            i += 1
        i += 1
        if attr in _INTEGERS:
            try:
                setattr(opts, attr, int(value))
            except ValueError:
                return None
        elif attr == "port_name":
            opts.port_name.append(value)
        else:
            setattr(opts, attr, value)
        if attr in _EXCLUSIVE:
            exclusive.add(attr)
    if len(exclusive) > 1 or log_level_error(opts.log_level):
        return None
    return opts


def log_level_error(name: str) -> str | None:
    try:
        log.set_level(name)
    except ValueError as e:
        return str(e)
    return None


def _argparse(argv: list[str]) -> Options:
    """The full parser: help, abbreviations, and the error messages."""
    import argparse

    p = argparse.ArgumentParser(prog="kibotos-guest", description="kibotos guest agent")
    p.add_argument("--port-name", action="append", default=[], metavar="NAME",
                   help=f"virtio-serial port to serve (repeatable; default {DEFAULT_PORT_NAME})")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--device", metavar="PATH", help="serve this character device instead")
    where.add_argument("--socket", metavar="PATH", help="listen on a unix socket (tests)")
    where.add_argument("--vsock", type=int, metavar="PORT",
                       help="listen on this AF_VSOCK port (guests without virtio-serial)")
    where.add_argument("--fd", type=int, metavar="N", help="serve an inherited descriptor")
    p.add_argument("--root", default="/", metavar="DIR",
                   help="resolve /etc files and mount points under DIR (tests)")
    p.add_argument("--sysfs", default="/sys/class/virtio-ports", help=argparse.SUPPRESS)
    p.add_argument("--dev-dir", default="/dev", help=argparse.SUPPRESS)
    p.add_argument("--advertise-protocol-version", type=int, default=PROTOCOL_VERSION,
                   help=argparse.SUPPRESS)  # tests of the host's version check
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO (default), WARNING, ERROR")
    args = p.parse_args(argv)
    problem = log_level_error(args.log_level)
    if problem:
        p.error(problem)
    opts = Options()
    for attr in vars(opts):
        setattr(opts, attr, getattr(args, attr))
    return opts


def parse_args(argv: list[str] | None = None) -> Options:
    """The options of `argv` (default: the process's); sets the log level.  Exits with
    status 2 and a usage message for a bad command line, as argparse does."""
    argv = sys.argv[1:] if argv is None else argv
    opts = _parse_plain(argv) or _argparse(argv)
    opts.port_name = opts.port_name or [DEFAULT_PORT_NAME]
    return opts


async def serve(args: Options) -> None:
    loop = get_loop()
    agent = Agent(root=args.root, protocol_version=args.advertise_protocol_version)
    stop = Event()
    if os.getpid() != 1:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    listener = None
    if args.socket:
        listener = listen(agent, args.socket)
        log.info("listening on %s", args.socket)
    elif args.vsock is not None:
        listener = listen_vsock(agent, args.vsock)
        log.info("listening on vsock port %d", args.vsock)
    elif args.fd is not None:
        agent.stop_when_idle = stop
        agent.add_channel(Channel(agent, f"fd {args.fd}", args.fd, reconnectable=False))
    else:
        wanted: list[tuple[str, Callable[[], str | None]]] = [
            (f"virtio-serial port {name}",
             functools.partial(find_port_device, name, args.sysfs, args.dev_dir))
            for name in args.port_name
        ]
        if args.device:
            wanted = [(args.device, functools.partial(str, args.device))]
        for describe, find in wanted:
            path, fd = await wait_for_device(describe, find)
            agent.add_channel(Channel(agent, path, fd, reconnectable=True))
            log.info("serving %s on %s", describe, path)
    loop.add_signal_handler(signal.SIGCHLD, agent.reap)
    agent.reap()  # children that ended before the handler was in place
    await stop.wait()
    if listener is not None:
        loop.remove_reader(listener.fileno())
        listener.close()
    agent.shutdown()


def _init_as_pid1() -> None:
    """As PID 1 nothing mounted the kernel's file systems for us."""
    from .runtime.sysio import sys_mount

    for target, fs_type in (("/proc", "proc"), ("/sys", "sysfs"), ("/dev", "devtmpfs")):
        if not os.path.ismount(target):
            try:
                os.makedirs(target, exist_ok=True)
                sys_mount(fs_type, target, fs_type, 0, "")
            except OSError as e:
                log.warning("mounting %s: %s", target, e)


#: Signals whose ignored state the agent must not hand down: an ignored signal stays
#: ignored across exec, so a `nohup`'d or detached starter would leave every process
#: in the Workspace deaf to hang-ups and interrupts (a hung-up exec would live on).
INHERITABLE_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM)


def reset_ignored_signals() -> None:
    """Give the processes the agent starts the default signal dispositions."""
    for sig in INHERITABLE_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reset_ignored_signals()
    if os.getpid() != 1:
        Loop().run(serve(args))
        return 0
    _init_as_pid1()
    while True:  # PID 1 must never exit: the kernel would panic
        try:
            Loop().run(serve(args))
        except Exception:
            log.exception("agent failed; restarting in 1 s")
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
