"""Rank-prefixed logging, set up once by the entry point (never at import time)."""

from __future__ import annotations

import logging
import sys

from . import config

__all__ = ["setup_logging"]


class _RankFilter(logging.Filter):
    def __init__(self, rank_of):
        super().__init__()
        self._rank_of = rank_of

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self._rank_of()
        return True


def setup_logging(rank_of) -> None:
    """Log ``[rank N] LEVEL name: message`` to stderr; ``rank_of`` returns the current rank
    (it changes across resizes)."""
    root = logging.getLogger("hpcadapt")
    for h in list(root.handlers):
        if getattr(h, "_hpcadapt", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler._hpcadapt = True  # type: ignore[attr-defined]
    handler.addFilter(_RankFilter(rank_of))
    handler.setFormatter(logging.Formatter("[rank %(rank)s] %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(config.log_level())
    root.propagate = False
