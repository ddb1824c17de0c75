"""Which accelerator works here: KVM only if a real guest boots under it in time.

TESTBED: on these machines ``/dev/kvm`` opens and ``KVM_CREATE_VM`` succeeds, yet
guests hang right after entering protected mode, so the device's existence proves
nothing.  The probe boots the Platform's own kernel and initramfs under KVM with
``kibotos.probe`` on the command line; the Platform init then prints
``KIBOTOS-PROBE-OK`` before touching any disk and powers off.  Seeing that line within
the deadline means KVM runs a real Linux guest to user space here.

The answer is cached per host in ``<cache_dir>/kvm-probe-<key>.json``, keyed by what
can change it: the host kernel and boot (``boot_id``: a reboot may load kvm with other
options), the QEMU binary and the probe kernel.  A hung probe costs its whole deadline,
so it is paid once per host boot, not at every node start.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio

from kibotos.sdk import atomicfile, procfs
from kibotos_qemu.cmdline import TCG_TRIMS

PROBE_MARKER = b"KIBOTOS-PROBE-OK"


def kvm_openable(dev: Path = Path("/dev/kvm")) -> str | None:
    """None if `dev` opens read-write, else the reason it does not."""
    try:
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return f"{dev}: {exc.strerror}"
    os.close(fd)
    return None


def probe_argv(qemu_binary: str, vmlinux: Path, initramfs: Path, *, accel: str = "kvm",
               host_mhz: int | None = None) -> list[str]:
    """A diskless guest whose console is QEMU's stdout, with the CPU and kernel flags a
    real launch under `accel` gets (TCG without its TSC flags hangs now and then)."""
    if accel == "kvm":
        machine = ["-accel", "kvm", "-cpu", "host"]
        extra: list[str] = []
    else:
        machine = ["-accel", "tcg,tb-size=32", "-cpu", "qemu64,+arat"]
        extra = [f"tsc_early_khz={host_mhz * 1000}"] if host_mhz else []
        extra += ["tsc=reliable", *TCG_TRIMS]
    return [
        qemu_binary, "-M", "microvm", *machine,
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-m", "128M", "-smp", "1",
        "-kernel", str(vmlinux), "-initrd", str(initramfs),
        "-append", " ".join(["console=ttyS0", "panic=-1", "quiet", *extra, "kibotos.probe"]),
        "-chardev", "stdio,id=console,signal=off", "-serial", "chardev:console",
    ]


async def boot_probe(argv: list[str], timeout: float) -> tuple[bool, str, float]:
    """Run `argv` until the probe marker appears on stdout, it exits, or `timeout`.

    Returns (booted, reason, seconds).  The QEMU process is killed in every case: the
    probe guest powers itself off, but a hung one never would."""
    started = time.monotonic()
    seen = b""
    try:
        proc = await trio.lowlevel.open_process(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as exc:
        return False, f"cannot run {argv[0]}: {exc.strerror}", 0.0
    try:
        assert proc.stdout is not None
        with trio.move_on_after(timeout):
            async for chunk in proc.stdout:
                seen = (seen + chunk)[-4096:]
                if PROBE_MARKER in seen:
                    return True, "probe guest booted", time.monotonic() - started
            tail = seen.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
            return (False, f"probe guest exited before booting: {tail[0][:200]}",
                    time.monotonic() - started)
        return False, f"probe guest did not boot within {timeout:g} s", \
            time.monotonic() - started
    finally:
        if proc.returncode is None:
            proc.kill()
        with trio.CancelScope(shield=True):
            await proc.wait()
            if proc.stdout is not None:
                await proc.stdout.aclose()


def cache_key(qemu_binary: str, vmlinux: Path, host_proc: Path = Path("/proc")) -> str:
    facts = [procfs.boot_id(host_proc) or ""]
    try:
        facts.append((host_proc / "sys" / "kernel" / "osrelease").read_text().strip())
    except OSError:
        facts.append("")
    for path in (Path(qemu_binary), vmlinux):
        try:
            st = path.stat()
            facts.append(f"{path}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            facts.append(f"{path}:missing")
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:32]


async def probe_kvm(*, qemu_binary: str, vmlinux: Path | None, initramfs: Path | None,
                    cache_dir: Path | None, timeout: float,
                    kvm_dev: Path = Path("/dev/kvm")) -> Mapping[str, Any]:
    """``{"usable": bool, "reason": str, "seconds": float, "cached": bool}``."""
    reason = kvm_openable(kvm_dev)
    if reason is not None:
        return {"usable": False, "reason": reason, "seconds": 0.0, "cached": False}
    if vmlinux is None or initramfs is None:
        return {"usable": False, "reason": "no Platform configured to boot a probe guest",
                "seconds": 0.0, "cached": False}
    cache_file = None
    if cache_dir is not None:
        cache_file = cache_dir / f"kvm-probe-{cache_key(qemu_binary, vmlinux)}.json"
        try:
            cached = atomicfile.read_json(cache_file)
            if isinstance(cached, dict) and isinstance(cached.get("usable"), bool):
                return {**cached, "cached": True}
        except (OSError, ValueError):
            pass
    booted, why, seconds = await boot_probe(probe_argv(qemu_binary, vmlinux, initramfs),
                                            timeout)
    result = {"usable": booted, "reason": why, "seconds": round(seconds, 3)}
    if cache_file is not None:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            atomicfile.write_json(cache_file, result)
        except OSError:
            pass  # an uncached answer is still an answer; the next start probes again
    return {**result, "cached": False}
