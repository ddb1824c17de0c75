#!/bin/sh
# Build the kibotos Platform (guest kernel + initramfs), or find it in the cache, and
# print its directory: vmlinux, initramfs, platform.json.  See docs/vm.md.
#
#   packaging/platform/build.sh [--cache-dir DIR] [--compression gzip|zstd|none]
#       [--kernel-deb FILE] [--busybox-deb FILE] [--tini-deb FILE]   (offline: local .debs)
#
# Needs apt (apt-cache, apt-get download) and dpkg-deb; nothing is installed on the host.
# The kernel comes from Debian's linux-image-amd64, busybox from busybox-static, the
# reaping init from tini.  Same inputs, same directory: a rebuild is instant.
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec env PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m kibotos.platform.build_platform "$@"
