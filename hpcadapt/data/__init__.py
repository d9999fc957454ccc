"""Data: the global data cursor (the sampler) and the loader over it. Imports ``base``."""
