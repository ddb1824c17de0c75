#!/usr/bin/env bash
# `make demo`: set up this machine and run the main job — a 3-node kibotos cluster on
# loopback under .dev-cluster/, left running, and `kibo node list` against it.
# Safe to run again: it installs only what is missing, and a running cluster is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIR=$ROOT/.dev-cluster
BIN=$ROOT/.venv/bin

say() { printf '\n==> %s\n' "$*" >&2; }

# 1. Debian packages.  python3-venv builds the venv; e2fsprogs and iproute2 are what a
#    node uses on its host.
PACKAGES=(make python3 python3-venv e2fsprogs iproute2)
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' \
        || missing+=("$p")
done
if ((${#missing[@]})); then
    say "installing Debian packages: ${missing[*]}"
    SUDO=()
    if [[ $(id -u) != 0 ]]; then
        command -v sudo >/dev/null || { echo "run as root or install sudo" >&2; exit 1; }
        SUDO=(sudo)
    fi
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# 2. The venv with kibotos and its built-in plugins (a no-op when up to date).
say "preparing the virtual environment in .venv"
make --no-print-directory venv

# 3. The cluster.
if "$BIN/kibotos" dev cluster status --dir "$DIR" --json 2>/dev/null \
        | grep -q '"running": true'; then
    say "a dev cluster is already running in .dev-cluster; reusing it"
else
    if [[ -e $DIR ]]; then
        say "removing the stopped cluster left in .dev-cluster"
        "$BIN/kibotos" dev cluster down --dir "$DIR" >/dev/null 2>&1 || true
        rm -rf "$DIR"
    fi
    say "starting ctrl and 3 nodes under .dev-cluster"
    "$BIN/kibotos" dev cluster up --dir "$DIR" --nodes 3
fi

say "kibo node list"
KIBO_CONFIG=$DIR/kibo.toml "$BIN/kibo" node list

cat >&2 <<MSG

The cluster keeps running.  To use it from this shell:

    export PATH=$BIN:\$PATH KIBO_CONFIG=$DIR/kibo.toml
    kibo node list
    kibo node get node-1

See what runs:  kibotos dev cluster status --dir $DIR
Logs:           $DIR/ctrl/ctrl.log, $DIR/nodes/<node>/node.log
Stop it:        kibotos dev cluster down --dir $DIR
MSG
