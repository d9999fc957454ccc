"""One error family for hpcadapt; recovery code dispatches on these types."""

__all__ = [
    "HpcAdaptError",
    "ConfigurationError",
    "CommunicationError",
    "MembershipError",
    "AllocationError",
    "PolicyError",
    "on_every_rank",
]


class HpcAdaptError(Exception):
    """Base of every error hpcadapt raises on purpose."""

    #: True when every rank raises it at the same point (rank 0's verdict was shared), so
    #: the job can end cleanly with one message instead of aborting the other ranks.
    all_ranks = False


def on_every_rank(error: HpcAdaptError) -> HpcAdaptError:
    """Mark ``error`` as raised by every rank at the same point; returns it."""
    error.all_ranks = True
    return error


class ConfigurationError(HpcAdaptError, ValueError):
    """A setting, flag or argument has a value hpcadapt cannot use."""


class CommunicationError(HpcAdaptError):
    """A collective could not run or its inputs disagree across ranks."""


class MembershipError(HpcAdaptError):
    """A resize (grow or shrink) could not be completed; the old world is kept."""


class AllocationError(HpcAdaptError):
    """The allocator could not provide or release the requested resources."""


class PolicyError(HpcAdaptError):
    """A policy failed or produced an unusable decision."""
