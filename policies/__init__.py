"""Adaptation policies (``hpcadapt.policies``)."""
