"""Which thread did something: an object of the thread's own, not its ident, which Python gives to later threads."""

from __future__ import annotations

import threading
from typing import Callable

__all__ = ["mark", "nameable"]


def _marker() -> tuple[Callable[[], object], Callable[[int, object], int]]:
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

    def nameable(stream: int, owner: object) -> int:
        """Stream handle ``stream`` of the thread ``owner`` marked, as this thread can name it: another thread's
        per-thread default stream (2) cannot be, and the legacy default stream (1), which follows the work of
        every thread's, stands for it.

        Example:
            >>> nameable(2, mark()), nameable(2, object()), nameable(0x5000, object())
            (2, 1, 20480)
        """
        return 1 if stream == 2 and owner is not mark() else stream

    return mark, nameable


mark, nameable = _marker()
