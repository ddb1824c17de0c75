"""The release identity of this build.

`__version__` is the release version (PEP 440 spelling of a SemVer release such as
``0.1.0`` or ``0.2.0a1``); builds that are not a release say ``unreleased`` on the
wire.  `SOURCE_REVISION` is filled in by the packaging scripts; a checkout reports
``unknown``.
"""

__version__ = "0.1.0.dev0"
SOURCE_REVISION = "unknown"


def release_version() -> str:
    """The version shown to operators: dev builds are ``unreleased``."""
    return "unreleased" if ".dev" in __version__ else __version__
