"""The parsers of every numeric flag (the command line's, a policy's parameters, a
strategy's settings), in one place below all of them: each raises ValueError naming the
rule the value broke (``hpcadapt.policies.argparse_type`` turns it into the usage error
that names the flag). ``hpcadapt.policies.params`` is the same module's names, for policy
authors."""

from __future__ import annotations

import math
from typing import Any, Callable, List, Sequence, Tuple

__all__ = ["positive_int", "non_negative_int", "positive_float", "non_negative_float",
           "float_above", "at_least", "fraction", "fraction_open", "fraction_below_one",
           "momentum", "seed", "positive_int_list", "choice", "step_map"]


def _converted(convert: Callable[[str], Any], text: str, what: str) -> Any:
    """``convert(text)``, or ValueError saying what was expected."""
    try:
        return convert(text)
    except ValueError:
        raise ValueError(f"expected {what}, got {text!r}") from None


def _integer(text: str, what: str) -> int:
    return _converted(int, text, what)


def _number(text: str, what: str) -> float:
    return _converted(float, text, what)


def positive_int(text: str) -> int:
    v = _integer(text, "a positive integer")
    if v < 1:
        raise ValueError(f"must be a positive integer (>= 1), got {v}")
    return v


def non_negative_int(text: str) -> int:
    v = _integer(text, "an integer >= 0")
    if v < 0:
        raise ValueError(f"must be >= 0, got {v}")
    return v


def positive_float(text: str) -> float:
    v = _number(text, "a positive number")
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"must be a positive finite number, got {text}")
    return v


def non_negative_float(text: str) -> float:
    v = _number(text, "a number >= 0")
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"must be 0 or a positive finite number, got {text}")
    return v


def float_above(bound: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        v = positive_float(text)
        if not v > bound:
            raise ValueError(f"must be greater than {bound}, got {v}")
        return v
    return parse


def at_least(bound: float) -> Callable[[str], float]:
    """A finite number of ``bound`` or more."""
    def parse(text: str) -> float:
        v = _number(text, f"a number of {bound:g} or more")
        if not (math.isfinite(v) and v >= bound):
            raise ValueError(f"must be {bound:g} or more, got {text}")
        return v
    return parse


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**32)."""
    v = _integer(text, "an integer in [0, 2**32)")
    if not 0 <= v < 2 ** 32:
        raise ValueError(f"must be in [0, 2**32), got {v}")
    return v


def positive_int_list(text: str) -> List[int]:
    """Comma-separated positive integers (``256,256``)."""
    values = _converted(lambda t: [int(v) for v in t.split(",") if v.strip()], text,
                        "comma-separated positive integers like 256,256")
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"expected positive integers like 256,256, got {text!r}")
    return values


def fraction(text: str) -> float:
    v = _number(text, "a number in [0, 1]")
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"must be in [0, 1], got {v}")
    return v


def fraction_open(text: str) -> float:
    """A weight in (0, 1]."""
    v = _number(text, "a number in (0, 1]")
    if not 0.0 < v <= 1.0:
        raise ValueError(f"must be in (0, 1], got {text}")
    return v


def fraction_below_one(text: str) -> float:
    """A fraction in [0, 1) (a momentum, a warm-up's share of the run)."""
    v = _number(text, "a number in [0, 1)")
    if not 0.0 <= v < 1.0:
        raise ValueError(f"must be in [0, 1), got {text}")
    return v


momentum = fraction_below_one


def choice(options: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"must be one of {', '.join(options)}; got {text!r}")
        return text
    return parse


def step_map(value: Callable[[str], object]) -> Callable[[str], List[Tuple[int, object]]]:
    """``AT:VALUE,AT:VALUE`` with increasing non-negative AT, e.g. ``0:32,200:64``."""
    def parse(text: str) -> List[Tuple[int, object]]:
        if not text.strip():
            return []
        out: List[Tuple[int, object]] = []
        for item in text.split(","):
            at, sep, val = item.partition(":")
            if not sep:
                raise ValueError(f"expected AT:VALUE pairs like 0:32,200:64; got {item!r}")
            point = non_negative_int(at.strip())
            if out and point <= out[-1][0]:
                raise ValueError(f"points must increase; {point} follows {out[-1][0]}")
            out.append((point, value(val.strip())))
        return out
    return parse
