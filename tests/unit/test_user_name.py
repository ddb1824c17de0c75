"""The one user-name rule (`kibotos.dataplane.clients.user_name`) that the CLI, the data
plane and the E2B gateway check: what passes, and a refusal naming what was wrong."""

from __future__ import annotations

import pytest

from kibotos.core.errors import InvalidArgument
from kibotos.dataplane.clients.user_name import (
    MAX_USER_NAME,
    check_user_name,
    optional_user_name,
)
from kibotos.guest.kibotos_guest import errors as guest_errors


@pytest.mark.parametrize("name", ["root", "user", "a", "www-data", "u" * MAX_USER_NAME,
                                  "first.last", "svc_1", "José"])
def test_names_that_pass(name: str) -> None:
    assert check_user_name(name) == name
    assert optional_user_name(name) == name


@pytest.mark.parametrize(("value", "why"), [
    ("", "1 to 32 characters"), ("u" * (MAX_USER_NAME + 1), "1 to 32 characters"),
    ("a\0b", "control characters"), ("a\nb", "control characters"),
    ("a\x1b[31m", "control characters"), ("a\x85", "control characters"),
    ("a\u2028", "control characters"), ("a:b", "':'"), ("../etc", "'/'"),
    (0, "(a string), not int"), (b"root", "(a string), not bytes"), (["root"], "not list"),
])
def test_names_that_are_refused_say_why(value: object, why: str) -> None:
    with pytest.raises(InvalidArgument, match=r"^exec: user must") as caught:
        check_user_name(value, "exec: user")
    assert why in caught.value.message


def test_absent_is_none_and_the_guest_agent_keeps_the_same_limit() -> None:
    assert optional_user_name(None) is None
    assert guest_errors.MAX_USER_NAME == MAX_USER_NAME
