"""The Slurm test cluster's own folder, munge key and PID checks (slurm/testcluster/cluster.py),
without Slurm: nothing here starts a daemon."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from hpcadapt.slurm.testcluster import cluster as tc

OTHER_UID = 54321  # a uid no one on the machine has
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another uid needs root")


@pytest.fixture
def no_slurm(monkeypatch):
    """Fail the test if the cluster tries to install packages or run a Slurm command."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"the test cluster went on to {args or kwargs}")

    monkeypatch.setattr(tc, "ensure_packages", refuse)
    monkeypatch.setattr(tc, "_run", refuse)


@pytest.fixture
def sleeper():
    """A process that is not a daemon of the cluster: `sleep`, ended after the test."""
    proc = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def ours(path) -> tc.TestCluster:
    c = tc.TestCluster(str(path))
    assert c.claim() is True
    c._new_pids_file()
    return c


def refusal(path) -> str:
    with pytest.raises(tc.ClusterError) as info:
        tc.TestCluster(str(path)).claim()
    msg = str(info.value)
    assert "\n" not in msg and "remove it or pass another folder" in msg, msg
    return msg


# -- the folder ------------------------------------------------------------------------------
def test_a_new_folder_is_created_private_and_marked(tmp_path):
    root = tmp_path / "a" / "b" / "cluster"
    c = tc.TestCluster(str(root))
    assert c.claim() is True
    for d in (tmp_path / "a", tmp_path / "a" / "b", root):  # every component created 0700
        st = os.lstat(d)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert st.st_uid == os.geteuid()
    marker = os.lstat(root / tc.MARKER)
    assert stat.S_ISREG(marker.st_mode) and stat.S_IMODE(marker.st_mode) == 0o600
    assert len(c.token) == 64 and c.token in (root / tc.MARKER).read_text()
    assert tc.read_marker(root) == c.token


def test_a_folder_a_previous_cluster_left_is_reused_with_its_token(tmp_path):
    first = ours(tmp_path / "c")
    again = tc.TestCluster(str(tmp_path / "c"))
    assert again.claim() is False and again.token == first.token


def test_new_folders_get_0700_whatever_the_umask(tmp_path):
    old = os.umask(0o277)  # would leave 0500
    try:
        tc.TestCluster(str(tmp_path / "c")).claim()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(tmp_path / "c").st_mode) == 0o700


def test_a_symlink_is_refused(tmp_path):
    ours(tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert "symlink" in refusal(tmp_path / "link")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert "symlink" in refusal(tmp_path / "dangling")
    assert not (tmp_path / "nowhere").exists()  # nothing created through the symlink


@as_root
def test_a_symlink_above_the_folder_that_someone_else_owns_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "planted"
    link.symlink_to(tmp_path / "elsewhere")
    os.lchown(link, OTHER_UID, OTHER_UID)
    assert "symlink that belongs to uid" in refusal(link / "cluster")
    assert list((tmp_path / "elsewhere").iterdir()) == []


@as_root
def test_a_folder_of_another_owner_is_refused(tmp_path):
    ours(tmp_path / "c")
    os.chown(tmp_path / "c", OTHER_UID, -1)
    assert f"belongs to uid {OTHER_UID}" in refusal(tmp_path / "c")


@pytest.mark.parametrize("mode", [0o770, 0o750, 0o705, 0o755, 0o1777])
def test_a_folder_with_group_or_other_permissions_is_refused(tmp_path, mode):
    ours(tmp_path / "c")
    os.chmod(tmp_path / "c", mode)
    assert f"mode {stat.S_IMODE(mode):04o}" in refusal(tmp_path / "c")


def test_a_folder_without_the_marker_is_refused(tmp_path):
    os.mkdir(tmp_path / "c", 0o700)  # private and ours, but not made by the cluster
    assert "no marker" in refusal(tmp_path / "c")


def test_a_marker_that_is_a_symlink_or_not_ours_is_refused(tmp_path):
    good = ours(tmp_path / "good")
    os.mkdir(tmp_path / "c", 0o700)
    (tmp_path / "c" / tc.MARKER).symlink_to(tmp_path / "good" / tc.MARKER)
    assert "marker" in refusal(tmp_path / "c")
    (tmp_path / "c" / tc.MARKER).unlink()
    (tmp_path / "c" / tc.MARKER).write_text("something else\n")
    os.chmod(tmp_path / "c" / tc.MARKER, 0o600)
    assert "marker" in refusal(tmp_path / "c")
    (tmp_path / "c" / tc.MARKER).write_text(f"hpcadapt-testcluster token={good.token}\n")
    os.chmod(tmp_path / "c" / tc.MARKER, 0o644)  # others may read it
    assert "marker" in refusal(tmp_path / "c")


def test_a_file_in_place_of_the_folder_is_refused(tmp_path):
    (tmp_path / "c").write_text("")
    os.chmod(tmp_path / "c", 0o600)
    assert "not a folder" in refusal(tmp_path / "c")


def test_up_and_down_refuse_a_foreign_folder_in_one_line_and_use_nothing_in_it(
        tmp_path, sleeper, capsys, no_slurm):
    """The probe's case: a folder at the cluster's place holding a munge key and a pid file
    that names a live process. Neither `up` nor `down` reads the key or signals the PID."""
    root = tmp_path / "c"
    os.mkdir(root, 0o755)
    (root / "etc").mkdir()
    (root / "etc" / "munge.key").write_bytes(b"k" * 1024)
    start = tc._proc_stat(sleeper.pid)[1]
    (root / "pids").write_text(f"{sleeper.pid}\nsleep {sleeper.pid} {start} sleep\n")
    for action in ("up", "down", "status"):
        assert tc.main([action, "--dir", str(root)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "remove it or pass another folder" in err, err
    assert sleeper.poll() is None
    assert (root / "etc" / "munge.key").read_bytes() == b"k" * 1024
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o755  # left as found


# -- the munge key ---------------------------------------------------------------------------
def test_the_munge_key_is_created_0600_and_kept_in_our_folder(tmp_path):
    c = ours(tmp_path / "c")
    c.etc.mkdir(mode=0o700)
    old = os.umask(0)  # the mode does not come from the umask
    try:
        key = c.munge_key()
    finally:
        os.umask(old)
    st = os.lstat(key)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 1024
    data = key.read_bytes()
    assert c.munge_key() == key and key.read_bytes() == data  # reused, not rewritten


def test_a_munge_key_that_is_a_symlink_or_readable_by_others_is_refused(tmp_path):
    c = ours(tmp_path / "c")
    c.etc.mkdir(mode=0o700)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    (c.etc / "munge.key").symlink_to(target)
    with pytest.raises(tc.ClusterError, match="remove it"):
        c.munge_key()
    assert target.read_bytes() == b""  # nothing written through the symlink
    (c.etc / "munge.key").unlink()
    (c.etc / "munge.key").write_bytes(b"k" * 1024)
    os.chmod(c.etc / "munge.key", 0o644)
    with pytest.raises(tc.ClusterError, match="remove it"):
        c.munge_key()


# -- the PIDs --------------------------------------------------------------------------------
def test_a_pid_that_is_not_the_daemon_recorded_is_not_signalled(tmp_path, sleeper, capsys,
                                                               no_slurm):
    c = ours(tmp_path / "c")
    c._record("slurmd-n1", sleeper.pid, "slurmd")  # right start time, but it runs `sleep`
    c.down()
    assert sleeper.poll() is None
    err = capsys.readouterr().err
    assert f"not signalling PID {sleeper.pid} (slurmd-n1): it runs 'sleep', not slurmd" in err


def test_a_pid_with_another_start_time_is_not_signalled(tmp_path, sleeper, capsys, no_slurm):
    c = ours(tmp_path / "c")
    start = tc._proc_stat(sleeper.pid)[1]
    with open(c.pids_file, "a") as f:  # the right command, but not the process started then
        f.write(f"sleeper {sleeper.pid} {start - 1} sleep\n")
    c.down()
    assert sleeper.poll() is None
    assert "the PID was reused" in capsys.readouterr().err


def test_a_dead_pid_is_skipped(tmp_path, capsys, no_slurm):
    c = ours(tmp_path / "c")
    done = subprocess.Popen(["true"])
    done.wait()
    c._record("munged", done.pid, "munged")
    assert c.recorded()[0].pid == done.pid
    c.down()
    assert f"not signalling PID {done.pid} (munged): no such process any more" in \
        capsys.readouterr().err
    assert c.recorded() == []  # the stale record is gone


def test_the_daemon_recorded_is_signalled(tmp_path, sleeper, capsys, no_slurm):
    """The control: the same checks let the process recorded at start through."""
    c = ours(tmp_path / "c")
    c._record("sleeper", sleeper.pid, "sleep")
    assert c.recorded() == [tc.Daemon("sleeper", sleeper.pid, tc._proc_stat(sleeper.pid)[1],
                                      "sleep")]
    c.down()
    assert sleeper.wait(timeout=30) == -15  # SIGTERM
    assert "stopped" in capsys.readouterr().out


def test_a_pid_file_of_another_folder_is_not_used(tmp_path, sleeper, capsys, no_slurm):
    c = ours(tmp_path / "c")
    other = ours(tmp_path / "other")
    other._record("sleeper", sleeper.pid, "sleep")
    os.replace(other.pids_file, c.pids_file)  # a pid file carrying another cluster's token
    c.down()
    assert sleeper.poll() is None
    assert "was not written by this folder's cluster" in capsys.readouterr().err


def test_proc_stat_reads_the_start_time_past_a_command_name_with_spaces(tmp_path):
    script = tmp_path / "a b) c"
    script.symlink_to("/bin/sleep")
    proc = subprocess.Popen([str(script), "600"])
    try:
        state, start = tc._proc_stat(proc.pid)
        with open(f"/proc/{proc.pid}/stat") as f:
            field22 = int(f.read().rsplit(")", 1)[1].split()[19])
        assert state in "RSD" and start == field22
        assert tc.why_not_daemon(tc.Daemon("x", proc.pid, start, "a b) c")) is None
    finally:
        proc.kill()
        proc.wait()


def test_the_default_folder_is_each_users_own(monkeypatch):
    """Two users of one machine never share (or refuse each other's) default folder."""
    import importlib

    monkeypatch.delenv("HPCADAPT_TESTCLUSTER_DIR", raising=False)
    fresh = importlib.reload(tc)
    try:
        assert fresh.DEFAULT_DIR.endswith(f"-{os.geteuid()}")
    finally:
        importlib.reload(tc)
