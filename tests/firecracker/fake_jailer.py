#!/usr/bin/env python3
"""A stand-in for Firecracker's jailer: checks its command line by the rules of the
jailer's documentation (docs/jailer.md), builds the jail as the jailer does, then execs
the stand-in Firecracker (`fc_standin`) in place, as the jailer execs Firecracker.

    fake_jailer.py --fake-config CONFIG.json <the jailer's arguments> [-- <Firecracker's>]

CONFIG.json: ``{"record": path, "standin_args": [...]}``: where to write what it
parsed and decided (one JSON object), and extra arguments for the stand-in (guest
ports, console text).  Tests put a two-line ``jailer`` script in front that adds
``--fake-config``, so the backend runs it like the real one.

What it does not do, unlike the jailer: chroot, pivot_root, mknod, setns, setrlimit and
dropping privileges (the stand-in checks file access by mode bits instead), and it
touches no cgroup; it records which cgroup action the jailer would take.  Errors are
printed as ``Jailer error: …`` with exit code 1, before anything is created.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path, PurePosixPath
from typing import Any

HERE = Path(__file__).resolve().parent
#: The jailer's flags: required with a value, optional with a value, repeatable, bare.
REQUIRED = ("id", "exec-file", "uid", "gid")
VALUED = {*REQUIRED, "chroot-base-dir", "netns", "cgroup-version", "parent-cgroup"}
MULTIPLE = {"cgroup", "resource-limit"}
FLAGS = {"daemonize", "new-pid-ns"}
DEFAULTS = {"chroot-base-dir": "/srv/jailer", "cgroup-version": "1"}
#: Folders the jailer creates in the jail, mode 0700, owned by uid:gid (env.rs).
JAIL_FOLDERS = ("dev", "dev/net", "run")


class JailerError(Exception):
    pass


def _relative_clean(value: str, what: str) -> None:
    parts = PurePosixPath(value).parts
    if value.startswith("/") or any(p in (".", "..") for p in parts) or \
            "/./" in f"/{value}/":
        raise JailerError(f"{what} {value!r}: path should not be absolute or contain "
                          "'..' or '.'")


def parse(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The jailer's arguments and the ones after ``--`` (for Firecracker)."""
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args: dict[str, Any] = {}
    it = iter(argv)
    for arg in it:
        if not arg.startswith("--"):
            raise JailerError(f"Found argument '{arg}' which wasn't expected")
        name = arg[2:]
        if name in FLAGS:
            if name in args:
                raise JailerError(f"The argument '{name}' was provided more than once.")
            args[name] = True
            continue
        if name not in VALUED | MULTIPLE:
            raise JailerError(f"Found argument '{name}' which wasn't expected")
        value = next(it, None)
        if value is None or value.startswith("--"):
            raise JailerError(f"The argument '{name}' requires a value, but none was supplied")
        if name in MULTIPLE:
            args.setdefault(name, []).append(value)
        elif name in args:
            raise JailerError(f"The argument '{name}' was provided more than once.")
        else:
            args[name] = value
    for name in REQUIRED:
        if name not in args:
            raise JailerError(f"Missing argument: {name}")
    return {**DEFAULTS, **args}, extra


def _cgroup2_root() -> Path | None:
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[2] == "cgroup2":
            return Path(fields[1])
    return None


def check(args: dict[str, Any]) -> dict[str, Any]:
    """Validate as the jailer does; returns the facts the jail is built from."""
    jail_id = args["id"]
    if not 1 <= len(jail_id) <= 64:
        raise JailerError(f"Invalid instance ID: Invalid len ({len(jail_id)});  the length "
                          "must be between 1 and 64")
    for i, c in enumerate(jail_id):
        if not (c == "-" or c.isalnum()):
            raise JailerError(f"Invalid instance ID: Invalid char ({c}) at position {i}")
    exec_file = Path(os.path.realpath(args["exec-file"]))
    if not exec_file.is_file():
        raise JailerError(f"{exec_file} is not a file")
    base = Path(os.path.realpath(args["chroot-base-dir"]))
    if not base.is_dir():
        raise JailerError(f"{base} is not a directory")
    ids = {}
    for key in ("uid", "gid"):
        value = args[key]
        if not value.isdigit() or int(value) > 2**32 - 1:
            raise JailerError(f"Invalid {key} value: {value}")
        ids[key] = int(value)
    if args["cgroup-version"] not in ("1", "2"):
        raise JailerError(f"{args['cgroup-version']} is an invalid cgroup version specifier")
    parent = args.get("parent-cgroup", exec_file.name)
    _relative_clean(parent, "Parent cgroup path")
    for cg in args.get("cgroup", []):
        file, eq, value = cg.partition("=")
        if not eq or not value or "=" in value:
            raise JailerError(f"Invalid format for cgroups: {cg}")
        _relative_clean(file, "cgroup file")
    for limit in args.get("resource-limit", []):
        name, eq, value = limit.partition("=")
        if name not in ("fsize", "no-file") or not value.isdigit():
            raise JailerError(f"Invalid resource argument: {limit}")
    if "netns" in args:
        try:
            os.close(os.open(args["netns"], os.O_RDONLY))
        except OSError as exc:
            raise JailerError(f"Failed to open the netns file {args['netns']}: {exc}") from None
    if args.get("cgroup") or args["cgroup-version"] == "1":
        action = f"create cgroup {parent}/{jail_id}"
    else:
        root = _cgroup2_root()
        target = root / parent if root is not None else None
        action = f"move into {target}" if target is not None and target.is_dir() else "none"
    return {"jail_id": jail_id, "exec_file": str(exec_file), "base": str(base),
            "chroot": str(base / exec_file.name / jail_id / "root"),
            "cgroup_action": action, **ids}


def build(facts: dict[str, Any]) -> Path:
    """The jail as the jailer leaves it for Firecracker: the directory (kept if it
    exists), a private copy of the executable, /dev, /dev/net and /run, all owned by
    uid:gid with mode 0700."""
    chroot = Path(facts["chroot"])
    chroot.mkdir(parents=True, exist_ok=True)
    uid, gid = facts["uid"], facts["gid"]
    exec_file = Path(facts["exec_file"])
    target = chroot / exec_file.name
    shutil.copyfile(exec_file, target, follow_symlinks=False)
    os.chmod(target, exec_file.stat().st_mode & 0o7777)
    os.chown(target, uid, gid)
    for folder in ("", *JAIL_FOLDERS):
        path = chroot / folder
        path.mkdir(exist_ok=True)
        os.chmod(path, 0o700)
        os.chown(path, uid, gid)
    return chroot


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--fake-config":
        print("fake_jailer: first argument must be --fake-config FILE", file=sys.stderr)
        return 2
    if argv[2:] == ["--version"]:
        print("Jailer v1.17.0-dev (stand-in)")
        return 0
    config = json.loads(Path(argv[1]).read_text())
    record = Path(config["record"])
    try:
        args, extra = parse(argv[2:])
        facts = check(args)
    except JailerError as exc:
        record.write_text(json.dumps({"error": str(exc), "argv": argv[2:]}))
        print(f"Jailer error: {exc}", file=sys.stderr)
        return 1
    chroot = build(facts)
    record.write_text(json.dumps({"args": args, "firecracker_args": extra, **facts}))
    fc_args = ["--id", facts["jail_id"], "--start-time-us", "0", "--start-time-cpu-us", "0",
               "--parent-cpu-time-us", "0", *extra]
    standin = [sys.executable, str(HERE / "fc_standin.py"), "--chroot", str(chroot),
               "--uid", str(facts["uid"]), "--gid", str(facts["gid"]),
               *config.get("standin_args", []), "--", *fc_args]
    sys.stdout.flush()
    os.execv(standin[0], standin)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
