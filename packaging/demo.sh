#!/usr/bin/env bash
# `make demo`: the newcomer's path on a Debian 12 machine, as root or with sudo.
#
#   1. the Debian packages it needs (only the missing ones),
#   2. the venv in .venv (the Makefile's `venv` target),
#   3. ctrl and one node on loopback under .dev-cluster/ (VMM backend qemu), left running,
#   4. the Template kibotos-base built and published (debootstrap; cached afterwards),
#   5. a Workspace from it, booted in a real microVM,
#   6. a command run in it with `kibo workspace exec`, and its output printed.
#
# Steps 3-6 are `python -m kibotos.dev.demo` (tests/e2e/test_demo.py runs the same).
# Safe to run again: a running cluster, the cached Template and the demo Workspace are
# reused, and the command runs again.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIR=$ROOT/.dev-cluster
BIN=$ROOT/.venv/bin

say() { printf '\n==> %s\n' "$*" >&2; }

# 1. Debian packages, the subset of .ci/run's list and packaging/apt-test-deps.txt the
#    demo uses: python3-venv builds the venv; e2fsprogs and iproute2 are what a node
#    uses on its host; qemu-system-x86 runs the microVMs; debootstrap builds the
#    Template (e2fsprogs makes its image).  postgresql and the systemd packages are for
#    `make test` only.
PACKAGES=(ca-certificates make python3 python3-venv e2fsprogs iproute2 qemu-system-x86
          debootstrap)
SUDO=()
if [[ $(id -u) != 0 ]]; then
    command -v sudo >/dev/null || { echo "make demo: run as root or install sudo" >&2; exit 1; }
    SUDO=(sudo)
fi
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' \
        || missing+=("$p")
done
if ((${#missing[@]})); then
    say "installing Debian packages: ${missing[*]}"
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    say "Debian packages: all there (${PACKAGES[*]})"
fi

# 2. The venv with kibotos and its built-in plugins (a no-op when up to date).  pip's
#    chatter goes to a log, shown only when the build fails: stdout stays the command's.
say "preparing the virtual environment in .venv"
venv_log=${TMPDIR:-/tmp}/kibotos-demo-venv.log
if ! make --no-print-directory venv >"$venv_log" 2>&1; then
    tail -n 40 "$venv_log" >&2
    echo "make demo: building the venv failed; the whole log is $venv_log" >&2
    exit 1
fi

# 3-6. Cluster, Template, Workspace, command.  Its stdout is the command's output.
"$BIN/python" -m kibotos.dev.demo --dir "$DIR" \
    --recipe "$ROOT/packaging/template/kibotos-base.toml"

ws=$(KIBO_CONFIG=$DIR/kibo.toml "$BIN/kibo" workspace list --label purpose=demo \
         --state AVAILABLE -q | head -1)
cat >&2 <<MSG

The cluster and the Workspace keep running.  To use them from this shell:

    export PATH=$BIN:\$PATH KIBO_CONFIG=$DIR/kibo.toml
    kibo workspace list
    kibo workspace exec $ws -- cat /etc/debian_version
    kibo workspace exec $ws --tty -- bash      # a shell in the microVM (exit to leave)

The E2B SDK against it (the E2B and Exposure gateways run on loopback):

    set -a; . $DIR/e2b.env; set +a
    $BIN/python -c 'from e2b import Sandbox; s = Sandbox.create(); print(s.commands.run("uname -a").stdout); s.kill()'

See what runs:  kibotos dev cluster status --dir $DIR
Logs:           $DIR/ctrl/ctrl.log, $DIR/nodes/node-1/node.log
Stop it all:    kibotos dev cluster down --dir $DIR
MSG
