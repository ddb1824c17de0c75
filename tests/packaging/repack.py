"""The built packages repacked as another release (``dpkg-deb -R``, the versions in the
control files and ``kibotos/_version.py`` bumped), for the tests that install one
version after another: test_deb_in_systemd.py (three releases in turn) and
test_piuparts.py (an older release to upgrade from)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from kibotos._version import __version__

VERSION_FILE = "usr/lib/kibotos/venv/lib/python3.11/site-packages/kibotos/_version.py"


def debian_version(pep440: str) -> str:
    """A PEP 440 version in Debian spelling (0.1.0.dev0 -> 0.1.0~dev0)."""
    return re.sub(r"\.?(dev|a|b|rc)(\d+)$", r"~\1\2", pep440)


def repack(debs: dict[str, Path], out: Path, pep440: str) -> None:
    """The same packages as release `pep440`, in the new directory `out`: the control
    files' versions (and so the exact dependencies on kibotos-common and the Breaks)
    and kibotos._version bumped."""
    old, new = debian_version(__version__), debian_version(pep440)
    out.mkdir()
    for deb in debs.values():
        tree = Path(tempfile.mkdtemp(dir=out.parent))
        subprocess.run(["dpkg-deb", "-R", str(deb), str(tree)], check=True, timeout=300)
        control = tree / "DEBIAN/control"
        control.write_text(control.read_text().replace(old, new))
        version = tree / VERSION_FILE
        if version.exists():
            version.write_text(re.sub(r'(?m)^__version__ = ".*"$',
                                      f'__version__ = "{pep440}"', version.read_text()))
        subprocess.run(["dpkg-deb", "-Zgzip", "-b", str(tree), str(out)], check=True,
                       capture_output=True, timeout=600)
        subprocess.run(["rm", "-rf", str(tree)], check=True)
