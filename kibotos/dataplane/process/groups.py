"""Getting the one meaningful error out of trio's exception groups.

trio wraps what a nursery's body raises in an exception group even when it is alone, and
several tasks often notice one dropped connection at once.  The data plane and its client
want the `KibotosError` that says what happened, with the cancellations beside it
ignored.
"""

from __future__ import annotations

import trio

from kibotos.core.errors import KibotosError


def leaves(exc: BaseException) -> list[BaseException]:
    """The non-group exceptions inside `exc`, depth first."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]


def kibotos_leaf(group: BaseExceptionGroup[BaseException]) -> KibotosError | None:
    """The first `KibotosError` in `group` when everything else in it is a
    cancellation; None otherwise (then the group must propagate as it is)."""
    found: KibotosError | None = None
    for leaf in leaves(group):
        if isinstance(leaf, KibotosError):
            found = found or leaf
        elif not isinstance(leaf, trio.Cancelled):
            return None
    return found


def sole_error(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception in `group` that is not a cancellation, if there is exactly one
    (or a `KibotosError` with only cancellations beside it)."""
    found = kibotos_leaf(group)
    if found is not None:
        return found
    real = [leaf for leaf in leaves(group) if not isinstance(leaf, trio.Cancelled)]
    return real[0] if len(real) == 1 else None
