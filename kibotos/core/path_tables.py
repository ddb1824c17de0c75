"""Directory layouts written as tables: each path is one line that names its parent.

A layout class (the dev cluster's, the node's state under ``storage.root``) is mostly
paths below other paths.  Written as properties, each takes three lines that all look
alike and hide the one fact that differs; written as ``identity_file = Below("pki",
"identity.json")``, the layout reads as the tree it is.
"""

from __future__ import annotations

from pathlib import Path


class Below:
    """A read-only attribute: `name` below the path in attribute `parent` of the same
    object (a dataclass field, or another `Below`)."""

    def __init__(self, parent: str, name: str) -> None:
        self.parent = parent
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> Path:
        return Path(getattr(obj, self.parent)) / self.name
