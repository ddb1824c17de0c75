"""The shapes of every identifier kibotos accepts, checked before anything is written.

IDs end up as file names, unit names and URL path segments, so their shape is part of
the contract: ctrl checks them, and a node checks them again before use.  The patterns
are public because the contract is: ctrl's OpenAPI document states each of them
(`schema_pattern`), so a client can check an ID before it sends one.
"""

from __future__ import annotations

import os
import re
import time

from kibotos.core.errors import InvalidArgument

# volume_id / opaque_ref: 1–32 bytes of lowercase letters, digits and hyphens, not
# starting with a hyphen (spec: storage-pools-on-nfs, "File names and object IDs").
OBJECT_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
# Pool IDs: 1–63 lowercase letters, digits, '-' and '.', not starting or ending with a
# separator (spec: storage-pools-on-nfs, "Configuration").
POOL_ID = re.compile(r"[a-z0-9](?:[a-z0-9.-]{0,61}[a-z0-9])?")
# Node IDs: a DNS label, so they fit unit names, file names and host names.
NODE_ID = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
# Command IDs: chosen by callers; '/' allowed so `move` can derive `<id>/stop`.
COMMAND_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
LABEL_KEY = re.compile(r"[a-z0-9](?:[a-z0-9._/-]{0,61}[a-z0-9])?")
# Label values: up to 63 letters, digits and . _ -, starting and ending with one of the
# first two, or empty.
LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?")
# Template names: like pool IDs (they become file and URL path segments, so "." and
# ".." must not be names: a separator never starts or ends one).
RESOURCE_NAME = POOL_ID
# Artifact digests: "sha256:<64 lowercase hex>"; the bare hex is accepted on input (but
# not in an artifact's URL, /v1/artifacts/sha256/<hex>, which has one spelling).
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
DIGEST = re.compile(rf"(?:sha256:)?({SHA256_HEX.pattern})")


def schema_pattern(regex: re.Pattern[str]) -> str:
    """`regex` as a JSON Schema ``pattern``: anchored at both ends, because a schema's
    pattern is a search while every check here is a full match.  The patterns use only
    what Python and ECMA-262 (JSON Schema's dialect) read alike."""
    return f"^(?:{regex.pattern})$"


_CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"


def _check(kind: str, pattern: re.Pattern[str], value: object, rule: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise InvalidArgument(f"invalid {kind} {value!r}: {rule}")
    return value


def check_object_id(value: object, kind: str = "object ID") -> str:
    return _check(
        kind,
        OBJECT_ID,
        value,
        "must be 1-32 bytes of lowercase letters, digits and hyphens, not starting with a hyphen",
    )


def check_pool_id(value: object) -> str:
    return _check(
        "pool ID",
        POOL_ID,
        value,
        "must be 1-63 lowercase letters, digits, '-' and '.', "
        "not starting or ending with a separator",
    )


def check_node_id(value: object) -> str:
    return _check(
        "node ID",
        NODE_ID,
        value,
        "must be 1-63 lowercase letters, digits and hyphens, "
        "not starting or ending with a hyphen",
    )


def check_command_id(value: object) -> str:
    return _check(
        "command ID",
        COMMAND_ID,
        value,
        "must be 1-128 characters of letters, digits and . _ : / -, "
        "starting with a letter or digit",
    )


def check_label_key(value: object) -> str:
    return _check(
        "label key",
        LABEL_KEY,
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
        RESOURCE_NAME,
        value,
        "must be 1-63 lowercase letters, digits, '-' and '.', "
        "not starting or ending with a separator",
    )


def digest_hex(value: object) -> str:
    """The 64 hex digits of an artifact digest given as ``sha256:<hex>`` or ``<hex>``."""
    m = DIGEST.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        raise InvalidArgument(
            f"invalid digest {value!r}: expected sha256:<64 lowercase hex digits>")
    return m.group(1)


def check_sha256_hex(value: object) -> str:
    """The 64 hex digits alone (an artifact's URL), as the canonical ``sha256:<hex>``."""
    return "sha256:" + _check("digest", SHA256_HEX, value, "expected 64 lowercase hex digits")


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
