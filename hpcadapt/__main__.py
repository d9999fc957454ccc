"""``python -m hpcadapt`` is the training entry point."""

import sys

# First, before torch loads: a stop signal from the scheduler waits until it can be handled.
from hpcadapt.base.preemption import block_stop_signals

block_stop_signals()

from hpcadapt.train import main  # noqa: E402

sys.exit(main())
