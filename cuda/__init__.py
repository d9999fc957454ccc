"""GPU data plane (``hpcadapt.cuda``)."""
