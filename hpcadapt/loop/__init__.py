"""The training loop's parts over the job's state: the step, bounded-delay rounds, the
boundary, resizing, failures, monitoring, stops and the progress-based schedule."""
