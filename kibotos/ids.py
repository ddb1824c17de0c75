"""The shapes of every identifier kibotos accepts, checked before anything is written.

IDs end up as file names, unit names and URL path segments, so their shape is part of
the contract: ctrl checks them, and a node checks them again before use.
"""

from __future__ import annotations

import os
import re
import time

from kibotos.errors import InvalidArgument

# volume_id / opaque_ref: 1–32 bytes of lowercase letters, digits and hyphens, not
# starting with a hyphen (spec: storage-pools-on-nfs, "File names and object IDs").
_OBJECT_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
# Pool IDs: 1–63 lowercase letters, digits, '-' and '.', not starting or ending with a
# separator (spec: storage-pools-on-nfs, "Configuration").
_POOL_ID = re.compile(r"[a-z0-9](?:[a-z0-9.-]{0,61}[a-z0-9])?")
# Node IDs: a DNS label, so they fit unit names, file names and host names.
_NODE_ID = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
# Command IDs: chosen by callers; '/' allowed so `move` can derive `<id>/stop`.
_COMMAND_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
_LABEL_KEY = re.compile(r"[a-z0-9](?:[a-z0-9._/-]{0,61}[a-z0-9])?")
# Template names: like pool IDs (they become file and URL path segments, so "." and
# ".." must not be names: a separator never starts or ends one).
_TEMPLATE_NAME = _POOL_ID
# Artifact digests: "sha256:<64 lowercase hex>"; the bare hex is accepted on input.
_DIGEST = re.compile(r"(?:sha256:)?([0-9a-f]{64})")

_CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"


def _check(kind: str, pattern: re.Pattern[str], value: object, rule: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise InvalidArgument(f"invalid {kind} {value!r}: {rule}")
    return value


def check_object_id(value: object, kind: str = "object ID") -> str:
    return _check(
        kind,
        _OBJECT_ID,
        value,
        "must be 1-32 bytes of lowercase letters, digits and hyphens, not starting with a hyphen",
    )


def check_pool_id(value: object) -> str:
    return _check(
        "pool ID",
        _POOL_ID,
        value,
        "must be 1-63 lowercase letters, digits, '-' and '.', "
        "not starting or ending with a separator",
    )


def check_node_id(value: object) -> str:
    return _check(
        "node ID",
        _NODE_ID,
        value,
        "must be 1-63 lowercase letters, digits and hyphens, "
        "not starting or ending with a hyphen",
    )


def check_command_id(value: object) -> str:
    return _check(
        "command ID",
        _COMMAND_ID,
        value,
        "must be 1-128 characters of letters, digits and . _ : / -, "
        "starting with a letter or digit",
    )


def check_label_key(value: object) -> str:
    return _check(
        "label key",
        _LABEL_KEY,
        value,
        "must be 1-63 lowercase letters, digits and . _ / -, starting and ending alphanumeric",
    )


def check_template_name(value: object) -> str:
    return check_resource_name(value, "template name")


def check_resource_name(value: object, kind: str) -> str:
    """A name an operator gives a named, revisioned resource (a Template, an Egress, a
    Resolver): the Template name rule, with `kind` naming what was wrong."""
    return _check(
        kind,
        _TEMPLATE_NAME,
        value,
        "must be 1-63 lowercase letters, digits, '-' and '.', "
        "not starting or ending with a separator",
    )


def digest_hex(value: object) -> str:
    """The 64 hex digits of an artifact digest given as ``sha256:<hex>`` or ``<hex>``."""
    m = _DIGEST.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        raise InvalidArgument(
            f"invalid digest {value!r}: expected sha256:<64 lowercase hex digits>")
    return m.group(1)


def check_digest(value: object) -> str:
    """An artifact digest in its canonical form, ``sha256:<hex>``."""
    return "sha256:" + digest_hex(value)


def new_id(prefix: str) -> str:
    """A sortable unique ID such as ``ws-01k6…``: 48-bit millisecond time + 80 random bits,
    Crockford base32 in lowercase (26 characters), so `prefix-` + ID stays within 32 bytes
    for prefixes of up to 5 characters."""
    value = (int(time.time() * 1000) << 80) | int.from_bytes(os.urandom(10), "big")
    chars = []
    for _ in range(26):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return f"{prefix}-{''.join(reversed(chars))}"
