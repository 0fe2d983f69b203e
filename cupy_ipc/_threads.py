"""Which thread did something: an object of the thread's own, not its ident, which Python gives to later threads."""

from __future__ import annotations

import threading
from typing import Callable

__all__ = ["mark"]


def _marker() -> Callable[[], object]:
    local = threading.local()

    # A closure, not module globals: also called while the interpreter tears modules down (a destructor's).
    def mark() -> object:
        """This thread's own object, never another thread's while something holds it.

        Example:
            >>> mark() is mark()
            True
        """
        try:
            return local.mark
        except AttributeError:
            m = local.mark = object()
            return m

    return mark


mark = _marker()
