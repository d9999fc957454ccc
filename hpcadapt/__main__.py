"""``python -m hpcadapt`` is the training entry point."""

import sys

from .train import main

sys.exit(main())
