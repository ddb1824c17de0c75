#!/bin/sh
# Build a kibotos Template image (default kibotos-base: Debian bookworm minbase +
# python3 + the guest agent), or find it in the cache, and print its directory:
# image (sparse raw ext4), template.json.  Needs root (debootstrap).  See docs/vm.md.
#
#   packaging/template/build.sh [--cache-dir DIR] [--name NAME] [--suite SUITE]
#       [--package PKG]... [--mirror URL] [--agent FILE] [--file SRC:DEST[:MODE]]...
#
# The mirror defaults to the one this machine's apt uses (/etc/apt/sources.list*).
# The debootstrapped tree is cached by (suite, packages, mirror), the image by that
# plus the digests of the files put in it: a new agent rebuilds in seconds.
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec env PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m kibotos.platform.build_template "$@"
