"""A user script whose code warns (warnings.warn) on each rank once the job exists: each
rank's warning is printed once by that rank, prefixed with its rank."""

import argparse
import warnings

import hpcadapt

parser = argparse.ArgumentParser()
hpcadapt.add_arguments(parser)
job = hpcadapt.Job(parser.parse_args())
warnings.warn(f"a warning from the user's code on rank {job.rank}")
hpcadapt.barrier()
