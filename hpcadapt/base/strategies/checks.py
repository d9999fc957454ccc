"""Range checks the built-in strategies share (one clear line each); their flags' parsers
are ``hpcadapt.base.parsers``'."""

from __future__ import annotations

from typing import Any

from hpcadapt.base.errors import ConfigurationError


def whole(flag: str, value: Any, least: int, what: str) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
        raise ConfigurationError(f"{flag} {value!r}: give a whole number of {what}, {least} "
                                 f"or more")
