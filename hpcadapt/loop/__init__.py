"""The training loop's parts: the policy engine (pure: a snapshot in, decisions out), the
monitors and the progress-based learning-rate schedule. Imports ``base`` and the policies."""
