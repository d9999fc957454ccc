"""Rank-prefixed logging, set up once by the entry point (never at import time)."""

from __future__ import annotations

import logging
import sys
from typing import Callable, Optional, Union

from hpcadapt.base import config
from hpcadapt.base.config import launch_rank
from hpcadapt.base.lifecycle import is_first_rank

__all__ = ["setup_logging"]


class _RankFilter(logging.Filter):
    """Names the rank in each record. Before the world exists (``rank_of`` returns None)
    every rank reads the same flags and says the same things: the launch's first rank
    speaks for all, the others' records are dropped (they were printed once per rank)."""

    def __init__(self, rank_of: Callable[[], Union[int, str, None]]):
        super().__init__()
        self._rank_of = rank_of

    def filter(self, record: logging.LogRecord) -> bool:
        rank = self._rank_of()
        if rank is None:
            if not is_first_rank():
                return False
            rank = launch_rank() or 0
        record.rank = rank
        # A worker still joining has a rank only in its own launch: it says what it is.
        record.who = rank if isinstance(rank, str) else f"rank {rank}"
        return True


def _world_rank() -> Optional[int]:
    runtime = sys.modules.get("hpcadapt.comm.world")
    return runtime.world().rank if runtime is not None and runtime.is_initialized() else None


class _ProgressAwareHandler(logging.StreamHandler):
    """A log line while a progress bar is on the terminal is printed above the bar (tqdm
    clears and redraws it), never glued onto it."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm = sys.modules.get("tqdm")
        if tqdm is None or not getattr(tqdm.tqdm, "_instances", None):
            return super().emit(record)
        try:
            tqdm.tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


def setup_logging(rank_of: Callable[[], Union[int, str, None]] = _world_rank) -> None:
    """Log ``[rank N] LEVEL name: message`` to stderr, hpcadapt's records and Python's
    warnings (``warnings.warn``, which printed without a rank); ``rank_of`` returns the
    current rank (it changes across resizes), a name for a process that has none in the
    job yet (``"joiner 1234"``), or None before the world exists."""
    handler = _ProgressAwareHandler(sys.stderr)
    handler._hpcadapt = True  # type: ignore[attr-defined]
    handler.addFilter(_RankFilter(rank_of))
    handler.setFormatter(logging.Formatter("[%(who)s] %(levelname)s %(name)s: %(message)s"))
    logging.captureWarnings(True)
    for name, level in (("hpcadapt", config.log_level()), ("py.warnings", logging.WARNING)):
        logger = logging.getLogger(name)
        for h in list(logger.handlers):
            if getattr(h, "_hpcadapt", False):
                logger.removeHandler(h)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
