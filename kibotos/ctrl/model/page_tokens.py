"""The opaque page tokens of the list routes (``next_page_token``/``page_token``).

Every list pages by key order ("after this ID"); the token carries that key and a
version, so a token from another version or a hand-made one is a clear
`invalid_argument` instead of a silently wrong page.  One module, so every list route
reads and writes the same token.
"""

from __future__ import annotations

import base64
import binascii
import json

from kibotos.core.errors import InvalidArgument


def encode_token(after: str) -> str:
    """The token of the page that starts after key `after`."""
    raw = json.dumps({"v": 1, "after": after}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def decode_token(token: str) -> str:
    """The key a token from `encode_token` names; anything else is `InvalidArgument`."""
    try:
        data = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        after = data["after"]
        if data.get("v") != 1 or not isinstance(after, str):
            raise ValueError
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise InvalidArgument(
            "invalid page_token: pass the next_page_token of the previous page as is"
        ) from None
    return after
