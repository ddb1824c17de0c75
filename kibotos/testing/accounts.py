"""System accounts the tests need, made the way the Debian package makes them
(``debian/kibotos.postinst``): ``kibotos-egress``, the user egress processes run as.

Tests run as root; a missing account is created (``useradd --system``) and left in
place, as the package would leave it, so a second run finds it.
"""

from __future__ import annotations

import pwd
import subprocess

EGRESS_USER = "kibotos-egress"


def ensure_system_user(name: str = EGRESS_USER) -> pwd.struct_passwd:
    """The account `name`, created as a system user without a home or shell when it
    does not exist yet."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    subprocess.run(["useradd", "--system", "--user-group", "--no-create-home",
                    "--no-log-init", "--home-dir", "/nonexistent",
                    "--shell", "/usr/sbin/nologin", "--comment", "kibotos test account",
                    name], check=True, capture_output=True)
    return pwd.getpwnam(name)
