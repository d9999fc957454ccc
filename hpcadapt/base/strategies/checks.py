"""Parsers and range checks the built-in strategies share (one clear line each)."""

from __future__ import annotations

import math
from typing import Any, Callable

from hpcadapt.base.errors import ConfigurationError


def whole(flag: str, value: Any, least: int, what: str) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
        raise ConfigurationError(f"{flag} {value!r}: give a whole number of {what}, {least} "
                                 f"or more")


def parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number") from None


def at_least(least: int) -> Callable[[str], int]:
    """A flag's parser for a whole number of ``least`` or more (the messages of
    ``policies.params.positive_int`` / ``non_negative_int``, which base cannot import)."""
    def parse(text: str) -> int:
        value = parse_int(text)
        if value < least:
            raise ValueError(f"must be a positive integer (>= 1), got {value}" if least == 1
                             else f"must be >= {least}, got {value}")
        return value
    return parse


def parse_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value
