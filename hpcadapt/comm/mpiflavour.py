"""Which MPI this process runs on, and what it can survive: said once at start, asked by the
failure path (ULFM's in-place recovery, or the MPICH path with its limits)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from hpcadapt.comm.mpi import MPI

from hpcadapt.base import config

__all__ = ["MPIFlavour", "flavour", "ULFM_LAUNCH"]

# The launch that turns Open MPI's fault tolerance on (docs/guides/failures.md "Any rank's
# death under one launch: Open MPI with ULFM").
ULFM_LAUNCH = "mpirun --with-ft ulfm --mca async_mpi_finalize 1 -n N python ..."


@dataclass(frozen=True)
class MPIFlavour:
    """The MPI library under mpi4py and whether a dead rank can be survived in place."""

    name: str            # "Open MPI", "MPICH", ...
    version: str         # "5.0.11"
    ulfm: bool           # Open MPI launched with --with-ft ulfm: errors, Revoke, Shrink

    @property
    def open_mpi(self) -> bool:
        return self.name == "Open MPI"

    def startup_line(self, recover: bool = True) -> str:
        """One line for the start of a job: the MPI and what a dead rank does to the job
        (``recover``: --on-failure recover)."""
        head = f"MPI: {self.name} {self.version}"
        if self.ulfm:
            return (f"{head} with ULFM fault tolerance: " +
                    ("any rank's death is survived in place" if recover else
                     "a rank's death ends the job (--on-failure stop)"))
        if self.open_mpi:
            return (f"{head} without fault tolerance: a rank's death ends the job; launch "
                    f"with `{ULFM_LAUNCH}` to survive it")
        return (f"{head}: a rank of the first launch that dies ends that whole launch (what "
                f"--checkpoint-every last saved remains); workers that joined as launches "
                f"of their own are " + ("survived" if recover else "not survived "
                                        "(--on-failure stop)"))


@lru_cache(maxsize=1)
def flavour() -> MPIFlavour:
    name, version = MPI.get_vendor()
    text = ".".join(str(v) for v in version)
    ulfm = (name == "Open MPI" and config.ompi_fault_tolerance()
            and hasattr(MPI.Comm, "Shrink") and hasattr(MPI.Comm, "Revoke"))
    return MPIFlavour(name, text, ulfm)
