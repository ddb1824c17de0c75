"""`UnitSpec` → the ``a(sv)`` property list of ``StartTransientUnit``.

systemd checks each property's D-Bus type strictly (a ``b`` sent as ``s`` is refused),
so every property a unit may carry is listed here with its signature, and values are
converted from what configuration and backends naturally write: ``"infinity"`` for a
limit, ``"yes"``/``"no"`` or a bool for a switch, a list of names for capabilities.  A
property name that is not listed is refused (`InvalidArgument`) rather than dropped:
silently losing ``LimitMEMLOCK`` would let a VMM start and fail much later.

The spec's unit settings arrive through ``UnitSpec.properties`` (the VMM backend sets
``Type``, ``Restart``, ``KillMode``, ``OOMPolicy``, ``Slice``, ``LimitMEMLOCK``,
``PrivateMounts``, ``NetworkNamespacePath``, ``User``, ``SupplementaryGroups``); the
command, environment, working directory and log file come from the spec's own fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kibotos.sdk import InvalidArgument, UnitSpec, procfs

#: ``(uint64)-1``: systemd's "infinity" for limits and sizes.
INFINITY = 2**64 - 1
#: systemd's default PATH for services; the node's own environment is not inherited.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Service types whose start job ends only after the command was executed, so that
#: `start` returning means the exec succeeded (the `Supervisor` contract).
START_TYPES = frozenset({"exec", "notify"})

#: Unit properties a spec may set, with their D-Bus signatures.
SIGNATURES: Mapping[str, str] = {
    # what runs and how it ends
    "Type": "s", "Restart": "s", "KillMode": "s", "KillSignal": "i", "SendSIGKILL": "b",
    "SendSIGHUP": "b", "OOMPolicy": "s", "OOMScoreAdjust": "i", "TimeoutStartUSec": "t",
    "TimeoutStopUSec": "t", "RestartUSec": "t", "Description": "s", "Slice": "s",
    "NotifyAccess": "s", "RemainAfterExit": "b",
    # who, where
    "User": "s", "Group": "s", "SupplementaryGroups": "as", "NetworkNamespacePath": "s",
    "PrivateMounts": "b", "PrivateTmp": "b", "PrivateDevices": "b", "NoNewPrivileges": "b",
    "ProtectSystem": "s", "ProtectHome": "s", "ReadWritePaths": "as",
    "ReadOnlyPaths": "as", "InaccessiblePaths": "as", "RuntimeDirectory": "as",
    "UMask": "u", "CapabilityBoundingSet": "t", "AmbientCapabilities": "t",
    # resources (cgroup)
    "MemoryMax": "t", "MemoryHigh": "t", "MemorySwapMax": "t", "TasksMax": "t",
    "CPUWeight": "t", "CPUQuotaPerSecUSec": "t", "IOWeight": "t", "Delegate": "b",
    # rlimits: each is sent as the hard limit and its ...Soft twin (both the same)
    "LimitMEMLOCK": "t", "LimitNOFILE": "t", "LimitNPROC": "t", "LimitCORE": "t",
    "LimitFSIZE": "t", "LimitAS": "t", "LimitSTACK": "t",
}
#: Set from `UnitSpec` fields; a property of the same name would contradict them.
FROM_SPEC = frozenset({"ExecStart", "ExecStartEx", "Environment", "WorkingDirectory",
                       "StandardOutput", "StandardError", "StandardOutputFileToAppend",
                       "StandardErrorFileToAppend", "StandardInput", "AddRef"})

#: Linux capability numbers (linux/capability.h), for the capability-set properties.
CAPABILITIES: Mapping[str, int] = {name: i for i, name in enumerate(procfs.CAPABILITIES)}
_TRUE = frozenset({"yes", "true", "on", "1"})
_FALSE = frozenset({"no", "false", "off", "0"})


def _bad(unit: str, name: str, value: Any, expected: str) -> InvalidArgument:
    return InvalidArgument(f"unit {unit}: property {name}={value!r}: expected {expected}")


def convert(unit: str, name: str, value: Any) -> tuple[str, Any]:
    """One property as ``(signature, value)`` in the D-Bus type systemd wants."""
    sig = SIGNATURES.get(name)
    if sig is None:
        if name in FROM_SPEC:
            raise InvalidArgument(f"unit {unit}: property {name} comes from the unit spec "
                                  "(argv, environment, working_directory, log_path); "
                                  "do not set it as a property")
        raise InvalidArgument(f"unit {unit}: unknown unit property {name!r} (known: "
                              f"{', '.join(sorted(SIGNATURES))})")
    if sig == "s":
        if not isinstance(value, str | Path):
            raise _bad(unit, name, value, "a string")
        return sig, str(value)
    if sig == "b":
        if isinstance(value, bool):
            return sig, value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return sig, value.lower() in _TRUE
        raise _bad(unit, name, value, "a boolean (or yes/no)")
    if sig in ("i", "u"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(unit, name, value, "an integer")
        if sig == "u" and value < 0:
            raise _bad(unit, name, value, "a non-negative integer")
        return sig, value
    if sig == "t":
        return sig, _uint64(unit, name, value)
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise _bad(unit, name, value, "a list of strings")
    return sig, [str(v) for v in value]


def _uint64(unit: str, name: str, value: Any) -> int:
    if name in ("CapabilityBoundingSet", "AmbientCapabilities") and \
            isinstance(value, list | tuple):
        mask = 0
        for cap in value:
            key = str(cap).upper()
            key = key if key.startswith("CAP_") else f"CAP_{key}"
            if key not in CAPABILITIES:
                raise _bad(unit, name, cap, "a capability name such as CAP_NET_ADMIN")
            mask |= 1 << CAPABILITIES[key]
        return mask
    if value == "infinity":
        return INFINITY
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INFINITY:
        raise _bad(unit, name, value, "a non-negative integer or 'infinity'")
    return value


def unit_properties(spec: UnitSpec, unit: str, argv: list[str],
                    log_path: Path | None) -> list[tuple[str, tuple[str, Any]]]:
    """The whole property list of the transient unit `unit` for `spec`."""
    props: list[tuple[str, tuple[str, Any]]] = []
    given = dict(spec.properties)
    service_type = given.setdefault("Type", "exec")
    if service_type not in START_TYPES:
        raise InvalidArgument(
            f"unit {unit}: Type={service_type!r} is not supported: start must return only "
            f"after the command was executed (use one of {', '.join(sorted(START_TYPES))})")
    for name, value in given.items():
        sig, converted = convert(unit, name, value)
        props.append((name, (sig, converted)))
        if name.startswith("Limit"):
            props.append((f"{name}Soft", (sig, converted)))
    env = {"PATH": DEFAULT_PATH, **spec.environment}
    for key in env:
        if not key or "=" in key or "\0" in key or "\0" in env[key]:
            raise InvalidArgument(f"unit {unit}: invalid environment variable name {key!r}")
    props.append(("Environment", ("as", [f"{k}={v}" for k, v in env.items()])))
    if spec.working_directory is not None:
        props.append(("WorkingDirectory", ("s", str(spec.working_directory))))
    if log_path is not None:
        props.append(("StandardOutputFileToAppend", ("s", str(log_path))))
        props.append(("StandardErrorFileToAppend", ("s", str(log_path))))
    # ExecStartEx with no-env-expand: systemd would otherwise expand ``$VAR`` and turn
    # ``$$`` into ``$`` in the arguments, which `UnitSpec.argv` does not ask for (and
    # ``direct`` does not do); found by kibotos.testing.supervisor_suite.
    props.append(("ExecStartEx", ("a(sasas)", [(argv[0], argv, ["no-env-expand"])])))
    # Keeps the unit loaded while our connection lives, even if it ends at once, so its
    # InvocationID and result can still be read after the start job.
    props.append(("AddRef", ("b", True)))
    return props
