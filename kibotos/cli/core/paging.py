"""Reading ctrl's paged lists, as every ``kibo … list`` with ``--page-token`` and
``--all`` does: one page by default, every page with ``--all``, and the token of the
next page so that a person can go on from where the listing stopped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kibotos.cli.core.output import Output

#: Fetches the page after a token (None: the first page).
PageFetch = Callable[[str | None], dict[str, Any]]


def read_pages(fetch: PageFetch, key: str, page_token: str | None,
               all_pages: bool) -> tuple[list[dict[str, Any]], str | None]:
    """The items under `key` of the page after `page_token`, and of every later one
    with `all_pages`; and the next page's token (None when none is left)."""
    items: list[dict[str, Any]] = []
    token = page_token
    while True:
        page = fetch(token)
        items.extend(page.get(key) or [])
        token = page.get("next_page_token") or None
        if not all_pages or not token:
            return items, token


def say_more(out: Output, token: str | None, noun: str) -> None:
    """Tell a person (never a script) how to read on, when a page is left."""
    if token and not out.as_json:
        out.message(f"more {noun}: add --page-token {token} (or --all)")
