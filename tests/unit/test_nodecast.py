"""The node-local state broadcast's receiving side alone (no MPI): it reads the root's
memory file, and declines (so that every rank falls back to MPI) where it cannot."""

import os

import numpy as np

from hpcadapt.comm import nodecast


def test_a_receiver_that_cannot_read_declines():
    src = np.arange(4096, dtype=np.int64)
    fd = nodecast._write_memfd([src], src.nbytes)
    try:
        out = np.zeros_like(src)
        st = os.fstat(fd)
        header = np.array([nodecast.node_key(), os.getpid(), fd, src.nbytes, st.st_dev,
                           st.st_ino])
        assert nodecast._read_from(header, [out], src.nbytes) == 1 and (out == src).all()
        other_node = header.copy()
        other_node[0] += 1
        assert nodecast._read_from(other_node, [np.zeros_like(src)], src.nbytes) == 0
        gone = header.copy()
        gone[2] = 9999  # no such descriptor
        assert nodecast._read_from(gone, [np.zeros_like(src)], src.nbytes) == 0
        assert nodecast._read_from(header, [np.zeros(10, np.int64)], 80) == 0  # wrong size
        other_file = header.copy()
        other_file[5] += 1  # the descriptor now names another file than the root's
        assert nodecast._read_from(other_file, [np.zeros_like(src)], src.nbytes) == 0
    finally:
        os.close(fd)


def test_the_transport_setting_is_checked(monkeypatch):
    import pytest

    from hpcadapt.base import config
    from hpcadapt.base.errors import ConfigurationError

    monkeypatch.setenv("HPCADAPT_STATE_TRANSPORT", "MPI")
    assert config.state_transport() == "mpi" and not nodecast.available()
    monkeypatch.setenv("HPCADAPT_STATE_TRANSPORT", "shm")
    with pytest.raises(ConfigurationError, match="'shm' is not one of auto, mpi"):
        config.state_transport()
