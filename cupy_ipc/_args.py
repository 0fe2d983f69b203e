"""Checks of the public functions' numeric arguments, with errors that say which argument and why."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

__all__ = ["checked_count", "checked_lease", "checked_wait", "shown"]


def shown(value: Any) -> Any:
    """``value`` for a message: an integer too long to print whole by its sign and size (past 4300 digits, str()
    raises ValueError instead of giving the text, and thousands of digits say nothing); another value too long
    by its type."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"{'-' if value < 0 else ''}(an integer of {value.bit_length()} bits)"
    try:
        long = len(str(value)) > 100
    except ValueError:  # (a Fraction of such integers, say)
        long = True
    return f"(a {type(value).__name__} too long to print)" if long else value


def checked_count(value: Any, what: str, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an integer of at least ``minimum`` (and at most ``maximum``, if given).

    Raises:
        TypeError: It is not an integer (a float, a string, a bool).
        ValueError: It is below ``minimum`` or above ``maximum``.

    Example:
        >>> checked_count(3, "consumers", 1)
        3
    """
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, not bool")
    try:
        n = operator.index(value)  # ints and NumPy integers; not floats
    except TypeError:
        raise TypeError(f"{what} must be an integer, not {type(value).__name__}") from None
    if n < minimum:
        raise ValueError(f"{what} must be at least {minimum}, not {shown(n)}")
    if maximum is not None and n > maximum:
        raise ValueError(f"{what} must be at most {maximum}, not {shown(n)}")
    return n


def checked_lease(lease: Any) -> float | None:
    """``lease`` as seconds (``None``: no lease); an infinite lease never runs out.

    Raises:
        TypeError: It is not a number.
        ValueError: It is not positive (or NaN).

    Example:
        >>> checked_lease(2)
        2.0
    """
    if lease is None:
        return None
    return _seconds(lease, "lease must be a number of seconds or None",
                    "lease must be a positive number of seconds (or None for no lease)", positive=True)


def checked_wait(seconds: Any, what: str) -> float:
    """``seconds`` of a wait as a float: zero or more (infinite: no end).

    Raises:
        TypeError: It is not a number.
        ValueError: It is negative (or NaN).

    Example:
        >>> checked_wait(0, "exit wait")
        0.0
    """
    return _seconds(seconds, f"{what} must be a number of seconds", f"{what} must be zero or more seconds",
                    positive=False)


def _seconds(value: Any, not_a_number: str, out_of_range: str, positive: bool) -> float:
    """``value`` as a float of seconds, positive or (not ``positive``) zero or more; the errors say
    ``not_a_number`` or ``out_of_range``, then what ``value`` was."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{not_a_number}, not {type(value).__name__}")
    if not (value > 0 if positive else value >= 0):  # NaN too
        raise ValueError(f"{out_of_range}, not {shown(value)}")
    try:
        seconds = float(value)
    except OverflowError:  # an integer past the largest float: longer than any wait, as inf is
        return math.inf
    if positive and not seconds > 0:  # a positive value too small for a float
        raise ValueError(f"{out_of_range}, not {shown(value)} (0.0 as a float)")
    return seconds
