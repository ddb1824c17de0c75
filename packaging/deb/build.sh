#!/usr/bin/env bash
# Builds the Debian packages kibotos-common_<version>_amd64.deb and
# kibotos-{node,ctrl,cli}_<version>_all.deb from a clean copy of a git revision (default
# HEAD: uncommitted changes in the work tree never leak into a package) with
# `dpkg-buildpackage -us -uc -b`, and prints their paths, one a line.  docs/packaging.md.
#
#   packaging/deb/build.sh [--rev REV] [--out DIR]      (default: HEAD, ./dist)
#
# Two steps:
#   1. the wheelhouse: the wheels of packaging/deb/requirements.txt (and of the build
#      tools in build-requirements.txt: click-man for debian/manpages.py) for the
#      system's Python 3.11, downloaded once with pip (its configured index and cache) into
#      $KIBOTOS_WHEELHOUSE (default ~/.cache/kibotos/deb-wheelhouse/<hash of the
#      requirements>), reused while the requirements do not change;
#   2. the package: debian/rules installs from that wheelhouse only (pip --no-index),
#      so this step runs without network.
# Missing build tools (build-essential, debhelper, python3.11-venv) are installed with
# apt-get when run as root; they are also in packaging/apt-test-deps.txt.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
rev=HEAD
out=$top/dist
while [[ $# -gt 0 ]]; do
    case $1 in
        --rev) rev=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) echo "build.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

# The pyenv python3 shim (and any venv) on a developer's PATH would break the build.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
py=/usr/bin/python3.11

missing=()
command -v dpkg-buildpackage >/dev/null || missing+=(dpkg-dev)
command -v dh >/dev/null || missing+=(debhelper)
dpkg-query -W -f='${Status}' build-essential 2>/dev/null | grep -q 'ok installed' \
    || missing+=(build-essential)
[[ -x $py ]] || missing+=(python3.11)
$py -c 'import ensurepip' 2>/dev/null || missing+=(python3.11-venv)
if [[ ${#missing[@]} -gt 0 ]]; then
    if [[ $(id -u) -ne 0 ]]; then
        echo "build.sh: install the build tools first: sudo apt-get install ${missing[*]}" >&2
        exit 1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

commit=$(git -C "$top" rev-parse --verify "$rev^{commit}")
work=$(mktemp -d "${TMPDIR:-/tmp}/kibotos-deb.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir "$work/src"
git -C "$top" archive --format=tar "$commit" | tar -x -C "$work/src"

# debian/changelog's version must be kibotos._version's, in Debian spelling
# (0.1.0.dev0 -> 0.1.0~dev0, 0.2.0a1 -> 0.2.0~a1).
pep440=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$work/src/kibotos/_version.py")
wanted=$(sed -E 's/\.?(dev|a|b|rc)([0-9]+)$/~\1\2/' <<<"$pep440")
have=$(cd "$work/src" && dpkg-parsechangelog -S Version)
if [[ $have != "$wanted" ]]; then
    echo "build.sh: debian/changelog says $have but kibotos/_version.py says $pep440" \
         "(expected $wanted): add a changelog entry (dch -v $wanted)" >&2
    exit 1
fi

# The runtime pins (installed into the venv) and the build tools (run from the
# wheelhouse only, debian/manpages.py), downloaded together.
reqs=$work/requirements-all.txt
cat "$work/src/packaging/deb/requirements.txt" \
    "$work/src/packaging/deb/build-requirements.txt" > "$reqs"
wheelhouse=${KIBOTOS_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/kibotos/deb-wheelhouse/$(sha256sum "$reqs" | cut -c1-16)}
if [[ ! -f $wheelhouse/.complete ]] || ! cmp -s "$reqs" "$wheelhouse/.complete"; then
    echo "build.sh: filling the wheelhouse $wheelhouse" >&2
    mkdir -p "$wheelhouse"
    $py -m venv "$work/pip"
    "$work/pip/bin/pip" download -q --disable-pip-version-check --only-binary=:all: \
        -d "$wheelhouse" -r "$reqs"
    cp "$reqs" "$wheelhouse/.complete"
fi

echo "build.sh: building kibotos $have from $commit" >&2
(cd "$work/src" && KIBOTOS_WHEELHOUSE=$wheelhouse KIBOTOS_SOURCE_REVISION=$commit \
    dpkg-buildpackage -us -uc -b >&2)  # stdout: only the paths below

mkdir -p "$out"
for f in "$work"/*.deb "$work"/*.buildinfo "$work"/*.changes; do
    [[ -e $f ]] && cp "$f" "$out/"
done
# The packages' paths, one a line (callers read them from stdout).
for f in "$work"/*.deb; do
    echo "$out/$(basename "$f")"
done
