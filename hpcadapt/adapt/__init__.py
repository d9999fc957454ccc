"""Adaptation's pure parts, below the training loop: what a step measures (monitors.py: noise
scale, gradient variance, timings), where its control values travel (control.py) and the
policy engine (engine.py: a snapshot in, a plan out). No MPI, no job state: each is built and
tested on its own. Imports ``base`` and the policies."""
