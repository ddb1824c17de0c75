#!/bin/sh
# Makes the package's virtual environment, /usr/lib/kibotos/venv, inside the staging
# directory DEST (debian/kibotos-common), from the wheels in WHEELHOUSE only (no index,
# no network).  Called by debian/rules (dh_auto_install).  The commands' links into it
# belong to the role packages (debian/kibotos-*.links).
#
# The venv is built in DEST but runs from /usr/lib/kibotos/venv, and also from any
# other place the package is extracted to (`dpkg-deb -x pkg.deb /tmp/kibotos-next`,
# which docs/upgrades.md uses to run the next version's check-upgrade before
# installing it).  So nothing in it names DEST or a fixed location:
#   * console scripts start with a two-line sh trampoline that runs the python3 next
#     to the script's real path (links resolved);
#   * bin/python3 is a link to the system's /usr/bin/python3.11 (pyvenv.cfg: home =
#     /usr/bin); Python finds the venv from the path it was started by;
#   * no .pyc in the package: postinst compiles the installed tree (checked by hash, so
#     time stamps do not matter), an extracted copy compiles or runs without them;
#   * activate scripts (they hard-code the path) and pip itself are left out: nothing
#     is ever installed into this venv on a host.
set -eu

DEST=$1
WHEELHOUSE=$2
PY=/usr/bin/python3.11
VENV=/usr/lib/kibotos/venv
SITE=lib/python3.11/site-packages
TOP=$(pwd)

if [ ! -d "$WHEELHOUSE" ]; then
    echo "build-venv: wheelhouse $WHEELHOUSE does not exist (packaging/deb/build.sh fills it)" >&2
    exit 1
fi

rm -rf "$DEST$VENV"
mkdir -p "$DEST/usr/lib/kibotos"
"$PY" -m venv "$DEST$VENV"
pip() { "$DEST$VENV/bin/python3" -m pip --no-input --disable-pip-version-check "$@"; }

# Runtime requirements (pinned), then kibotos and every built-in plugin, built from this
# tree in isolated environments whose setuptools also comes from the wheelhouse.
grep -v '^setuptools==' packaging/deb/requirements.txt > "$DEST/../venv-requirements.txt"
set --
for plugin in plugins/*/pyproject.toml; do
    set -- "$@" "./$(dirname "$plugin")"
done
pip install --no-index --find-links "$WHEELHOUSE" --no-compile --only-binary=:all: \
    -r "$DEST/../venv-requirements.txt"
# One build environment (setuptools from the wheelhouse) for all ten local projects is
# much faster than pip's isolated environment per project.
BUILDENV=$TOP/debian/.buildenv
rm -rf "$BUILDENV" "$TOP/debian/.wheels"
"$PY" -m venv "$BUILDENV"
"$BUILDENV/bin/python3" -m pip install -q --no-index --find-links "$WHEELHOUSE" \
    "$(grep '^setuptools==' packaging/deb/requirements.txt)"
"$BUILDENV/bin/python3" -m pip wheel -q --no-index --no-deps --no-build-isolation \
    -w "$TOP/debian/.wheels" . "$@"
pip install --no-index --no-compile --no-deps "$TOP"/debian/.wheels/*.whl
rm -rf "$BUILDENV" "$TOP/debian/.wheels"
pip check
pip uninstall -q -y pip setuptools
rm -f "$DEST/../venv-requirements.txt"

# Fill in the source revision when the caller knows it (a git archive has no .git).
if [ -n "${KIBOTOS_SOURCE_REVISION:-}" ]; then
    sed -i "s/^SOURCE_REVISION = \"unknown\"$/SOURCE_REVISION = \"$KIBOTOS_SOURCE_REVISION\"/" \
        "$DEST$VENV/$SITE/kibotos/_version.py"
fi

# pyvenv.cfg: Python 3.11.4+ records the creating command line (with DEST).
sed -i '/^command = /d' "$DEST$VENV/pyvenv.cfg"
rm -f "$DEST$VENV"/bin/activate* "$DEST$VENV"/bin/Activate.ps1
# direct_url.json records the build directory the local projects came from.
find "$DEST$VENV/$SITE" -name direct_url.json -delete
find "$DEST$VENV" -name __pycache__ -prune -exec rm -rf {} +

# Console scripts: replace "#!<DEST>/usr/lib/kibotos/venv/bin/python3" with a
# trampoline (valid as sh and as Python, the form pip itself uses for long paths).
for script in "$DEST$VENV"/bin/*; do
    if [ ! -f "$script" ] || [ -L "$script" ]; then
        continue
    fi
    first=$(head -c 2 "$script")
    [ "$first" = "#!" ] || continue
    if head -n 1 "$script" | grep -q "^#!$DEST$VENV/bin/python"; then
        {
            printf '%s\n' '#!/bin/sh' \
                "'''exec' \"\$(dirname -- \"\$(realpath -- \"\$0\")\")/python3\" \"\$0\" \"\$@\"" \
                "' '''"
            tail -n +2 "$script"
        } > "$script.new"
        chmod 0755 "$script.new"
        mv "$script.new" "$script"
    fi
done

# Extension modules: strip them as dh_strip would (--strip-unneeded keeps the dynamic
# symbols; zstandard's two modules alone carry 23 MB of debug information).  The
# libraries auditwheel bundled in *.libs/ stay exactly as shipped.
find "$DEST$VENV/$SITE" -path '*.libs' -prune -o -type f -name '*.so' \
    -exec strip --strip-unneeded --remove-section=.comment --remove-section=.note {} +

# No byte code in the package (Debian's Python policy): postinst compiles it in place,
# prerm removes it.

# RECORD: pip hashed the console scripts with their first line naming DEST (a new
# temporary directory every build) and the extension modules before they were
# stripped, and lists files removed above; give the files as shipped their own hash and
# size and drop the rows of removed ones, so RECORD is true and
# two builds of one revision give the same package (reproducible builds).
"$PY" - "$DEST$VENV/$SITE" <<'PYEOF'
import base64, csv, hashlib, io, os, sys

site = sys.argv[1]
for entry in sorted(os.listdir(site)):
    record = os.path.join(site, entry, "RECORD")
    if not entry.endswith(".dist-info") or not os.path.isfile(record):
        continue
    with open(record, newline="") as f:
        rows = list(csv.reader(f))
    kept = []
    for row in rows:
        full = os.path.normpath(os.path.join(site, row[0]))
        if len(row) == 3 and row[1]:
            if not os.path.lexists(full):
                continue  # removed above (direct_url.json, pip, activate scripts)
            if os.path.isfile(full) and not os.path.islink(full):
                with open(full, "rb") as f:
                    data = f.read()
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
                row = [row[0], "sha256=" + digest.rstrip(b"=").decode(), str(len(data))]
        kept.append(row)
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(kept)
    with open(record, "w", newline="") as f:
        f.write(out.getvalue())
PYEOF

# Nothing may still name the staging directory.
if leftovers=$(grep -rlF -- "$DEST" "$DEST$VENV"); then
    echo "build-venv: these files still name the build directory $DEST:" >&2
    echo "$leftovers" >&2
    exit 1
fi

# The commands the role packages link to (debian/kibotos-*.links): /usr/bin/kibotos
# (common), kibotos-node and the runtime directory of docs/upgrades.md, `check-upgrade
# --runtime-dir /usr/lib/kibotos/node`, the directory that holds the kibotos package
# (node), kibo (cli).
for cmd in kibotos kibo kibotos-node; do
    test -x "$DEST$VENV/bin/$cmd"
done
test -d "$DEST$VENV/$SITE/kibotos"
