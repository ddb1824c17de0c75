"""The labels the E2B gateway keeps on a sandbox's Workspace, which the Exposure
gateway reads: ctrl's record is the one both gateways see, so what decides who may
reach a sandbox lives there, not in one gateway's state directory.

* `TEAM_LABEL`: the team whose key created the sandbox; a Workspace without it is no
  E2B sandbox, and the Exposure gateway does not expose it.
* `TRAFFIC_LABEL`: present when the sandbox was created with
  ``allow_public_traffic: false``; its value is `traffic_digest` of the sandbox's
  traffic access token.  A digest of a 256-bit token tells nothing about the token, so
  showing it in a Workspace get or list leaks no secret.
* `AUTO_RESUME_LABEL`: ``true`` when the sandbox was created with ``autoResume``:
  traffic to it while it is paused, through either gateway, starts it again.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

TEAM_LABEL = "e2b.team"
TRAFFIC_LABEL = "e2b.traffic-token-sha256"
AUTO_RESUME_LABEL = "e2b.auto-resume"
#: The header a client sends the traffic access token in (E2B's name).
TRAFFIC_HEADER = "e2b-traffic-access-token"


def traffic_digest(token: str) -> str:
    """SHA-256 of the token, lowercase base32 without padding: 52 characters, a
    valid label value."""
    digest = hashlib.sha256(token.encode()).digest()
    return base64.b32encode(digest).decode().rstrip("=").lower()


def traffic_allowed(labels: dict[str, str], presented: str | None) -> bool:
    """Whether a request may reach the sandbox: always when its traffic is public,
    else only with the token whose digest the label holds."""
    expected = labels.get(TRAFFIC_LABEL)
    if expected is None:
        return True
    return presented is not None and hmac.compare_digest(
        traffic_digest(presented).encode(), expected.encode())


def auto_resumes(labels: dict[str, str]) -> bool:
    """Whether traffic to the sandbox while it is paused should wake it."""
    return labels.get(AUTO_RESUME_LABEL) == "true"
