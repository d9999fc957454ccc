#!/usr/bin/env python3
"""A real Slurm cluster on this one machine, for tests, CI and the Slurm quick start.

munge, MariaDB, slurmdbd, slurmctld and one slurmd per emulated node (n1..n4), every file
(configuration, state, logs, pid files, sockets) under one private folder. The folder is the
cluster's own: created fresh with mode 0700 (never through a symlink) and marked with a random
token; a folder that exists with another owner, group/other permissions, no marker, or as a
symlink is refused, and nothing in it (munge key, pid file) is used. Daemons run in the
foreground in their own sessions and are stopped by the PIDs recorded at start, each signalled
only after /proc shows it is still the daemon recorded (same command, same start time), never
by name. Missing packages are installed from Debian's registry.

    python3 slurm/testcluster/cluster.py up [--dir DIR] [--nodes 4]
    python3 slurm/testcluster/cluster.py down [--dir DIR]
    python3 slurm/testcluster/cluster.py env [--dir DIR]   # prints export SLURM_CONF=...

It stands alone (standard library only) so that it runs before hpcadapt is installed."""

from __future__ import annotations

import argparse
import os
import re
import secrets
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

# One default folder per user: a second user's cluster never meets the first one's folder.
DEFAULT_DIR = os.environ.get("HPCADAPT_TESTCLUSTER_DIR", f"/tmp/hpcadapt-slurm-{os.geteuid()}")
CLUSTER_NAME = "hpcadapt"
PACKAGES = {"slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sbatch": "slurm-client",
            "slurmdbd": "slurmdbd", "munged": "munge", "mariadbd": "mariadb-server"}
PORTS = {"slurmctld": 16817, "slurmdbd": 16819, "mariadb": 16306, "slurmd_base": 17001}
MARKER = ".hpcadapt-testcluster"
_MARKER_LINE = "hpcadapt-testcluster token={}"
_MARKER_RE = re.compile(r"hpcadapt-testcluster token=([0-9a-f]{64})\n?")
_ADVICE = "remove it or pass another folder (--dir or HPCADAPT_TESTCLUSTER_DIR)"


class ClusterError(RuntimeError):
    pass


class Daemon(NamedTuple):
    """One daemon as recorded at start: its label, PID, start time (clock ticks after boot,
    field 22 of /proc/PID/stat) and executable name."""

    label: str
    pid: int
    start: int
    exe: str


# -- the cluster's own folder ----------------------------------------------------------------
def _refusal(path: Path, why: str) -> ClusterError:
    return ClusterError(f"refusing {path}: {why}; {_ADVICE}")


def _check_ancestors(path: Path) -> None:
    """A folder above the cluster's that is a symlink must belong to root or to us: one that
    someone else planted (in /tmp, say) could send the cluster's files anywhere."""
    for p in [path, *path.parents]:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, os.geteuid()):
            raise _refusal(p, f"it is a symlink that belongs to uid {st.st_uid}")


def _check_created(path: Path) -> None:
    """After os.mkdir: the path is the folder we made (lstat: a folder, not a symlink, ours),
    with mode 0700 (set again through a descriptor opened without following symlinks when the
    umask took more away)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise _refusal(path, "it was replaced while the test cluster was creating it")
    if st.st_uid != os.geteuid():
        raise _refusal(path, f"it belongs to uid {st.st_uid}, not to uid {os.geteuid()}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if (os.fstat(fd).st_ino, os.fstat(fd).st_dev) != (st.st_ino, st.st_dev):
                raise _refusal(path, "it was replaced while the test cluster was creating it")
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)


def read_marker(root: Path) -> str:
    """The token in the marker of a folder the cluster created, once the marker is checked:
    a regular file of ours that only we may read (opened without following a symlink), with
    the one line the cluster writes."""
    try:
        fd = os.open(root / MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _refusal(root, f"it has no marker {MARKER}, so the test cluster did not create "
                             "it") from None
    except OSError as exc:  # ELOOP: the marker is a symlink
        raise _refusal(root, f"its marker {MARKER} cannot be opened safely "
                             f"({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        text = f.read(4096) if stat.S_ISREG(st.st_mode) else b""
    match = _MARKER_RE.fullmatch(text.decode("ascii", "replace"))
    if (match is None or not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
            or st.st_mode & 0o077):
        raise _refusal(root, f"its marker {MARKER} is not one the test cluster wrote")
    return match.group(1)


def check_folder(root: Path) -> str:
    """Check that ``root`` is the cluster's own folder (a folder, not a symlink, ours, mode
    0700, with our marker) and return its token; raise ClusterError with one line saying what
    is wrong and what to do otherwise."""
    _check_ancestors(root.parent)
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        raise _refusal(root, "it is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise _refusal(root, "it is not a folder")
    if st.st_uid != os.geteuid():
        raise _refusal(root, f"it belongs to uid {st.st_uid}, not to uid {os.geteuid()}")
    if st.st_mode & 0o077:
        raise _refusal(root, f"group or others have permissions on it (mode "
                             f"{stat.S_IMODE(st.st_mode):04o}, not 0700)")
    return read_marker(root)


def create_folder(root: Path) -> str:
    """Create ``root`` fresh, and any missing folder above it, each with os.mkdir(mode 0700)
    and checked with lstat (a symlink or a folder that appears meanwhile is refused); write
    the marker with a new random token (O_EXCL, O_NOFOLLOW, mode 0600) and return the token."""
    _check_ancestors(root.parent)
    missing = []
    p = root
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            raise _refusal(d, "it appeared while the test cluster was creating it") from None
        _check_created(d)
    token = secrets.token_hex(32)
    _private_file(root / MARKER, lambda: (_MARKER_LINE.format(token) + "\n").encode(),
                  reuse=False)
    return token


def _private_file(path: Path, make: Callable[[], bytes], reuse: bool = True) -> Path:
    """Create ``path`` with mode 0600 through os.open(O_CREAT | O_EXCL | O_NOFOLLOW), never
    through a symlink. With ``reuse``, one that exists is kept when it is a regular file of ours
    that only we may use (callers reach this only inside the cluster's checked folder)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        st = os.lstat(path)
        if (not reuse or not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                or st.st_mode & 0o077):
            raise ClusterError(f"refusing {path}: not a private file the test cluster made "
                               f"(a regular file of ours, mode 0600); remove it") from None
        return path
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(make())
    return path


# -- the daemons' PIDs -------------------------------------------------------------------------
def _proc_stat(pid: int) -> Optional[Tuple[str, int]]:
    """(state, start time) from /proc/PID/stat (fields 3 and 22), or None without the process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
        rest = text[text.rindex(")") + 2:].split()  # the command name may hold spaces or ')'
        return rest[0], int(rest[19])
    except (OSError, ValueError, IndexError):
        return None


def _proc_names(pid: int) -> Tuple[str, str]:
    """(comm, basename of argv[0]) of a process, empty where unreadable."""
    names = []
    for leaf in ("comm", "cmdline"):
        try:
            with open(f"/proc/{pid}/{leaf}", "rb") as f:
                raw = f.read()
        except OSError:
            raw = b""
        raw = raw.split(b"\0")[0] if leaf == "cmdline" else raw.rstrip(b"\n")
        names.append(os.path.basename(raw.decode("utf-8", "replace")))
    return names[0], names[1]


def why_not_daemon(d: Daemon) -> Optional[str]:
    """None when PID ``d.pid`` is still the daemon recorded: it runs, its command (comm or
    argv[0]) is ``d.exe``, and it started at the recorded time; else why not."""
    st = _proc_stat(d.pid)
    if st is None or st[0] in ("Z", "X"):
        return "no such process any more"
    comm, argv0 = _proc_names(d.pid)
    if comm != d.exe[:15] and argv0 != d.exe:
        return f"it runs {argv0 or comm!r}, not {d.exe}"
    if st[1] != d.start:
        return (f"it started at tick {st[1]}, not at {d.start} as recorded (the PID was "
                "reused)")
    return None


def _send(d: Daemon, pidfd: Optional[int], sig: int) -> None:
    try:
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, sig)
        else:
            os.kill(d.pid, sig)
    except ProcessLookupError:
        pass


def _wait_gone(d: Daemon, pidfd: Optional[int], timeout: float) -> bool:
    if pidfd is not None:  # readable once the process has exited
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(int(timeout * 1000)))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if why_not_daemon(d) is not None:
            return True
        time.sleep(0.1)
    return False


def stop_daemon(d: Daemon, timeout: float) -> Optional[str]:
    """SIGTERM the recorded daemon (SIGKILL after ``timeout`` s) once /proc shows it is still
    that daemon; return why it was not signalled, or None. The check comes after
    os.pidfd_open, so a PID reused in between fails the check instead of being signalled."""
    try:
        pidfd: Optional[int] = os.pidfd_open(d.pid)
    except ProcessLookupError:
        return "no such process any more"
    except (AttributeError, OSError):
        pidfd = None  # no pidfd here: the signal follows the check at once
    try:
        why = why_not_daemon(d)
        if why is not None:
            return why
        _send(d, pidfd, signal.SIGTERM)
        if not _wait_gone(d, pidfd, timeout):
            if pidfd is not None or why_not_daemon(d) is None:
                _send(d, pidfd, signal.SIGKILL)
                _wait_gone(d, pidfd, 10)
        return None
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _run(cmd: List[str], *, env: Optional[Dict[str, str]] = None, check: bool = True,
         timeout: float = 120, input_text: Optional[str] = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          input=input_text)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed with {proc.returncode}: "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def ensure_packages() -> None:
    """Install the Debian packages that are missing (needs root and the package registry)."""
    missing = sorted({pkg for exe, pkg in PACKAGES.items()
                      if not shutil.which(exe) and not os.path.exists(f"/usr/sbin/{exe}")})
    if not missing:
        return
    if os.geteuid() != 0:
        raise ClusterError(f"missing {' '.join(missing)}; install them (apt-get install "
                           f"{' '.join(missing)}) or run this as root")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    print(f"installing {' '.join(missing)} ...", flush=True)
    install = ["apt-get", "install", "-y", "-q"] + missing
    if _run(install, env=env, check=False, timeout=900).returncode != 0:
        _run(["apt-get", "update", "-q"], env=env, timeout=600)
        _run(install, env=env, timeout=900)


class TestCluster:
    """One test cluster rooted at ``root``."""

    def __init__(self, root: str = DEFAULT_DIR, nodes: int = 4, cpus_per_node: int = 2):
        # abspath, not resolve(): resolving would follow the symlink the folder checks refuse.
        self.root = Path(os.path.abspath(root))
        self.token: Optional[str] = None  # the marker's, once the folder is checked
        self.nodes = nodes
        self.cpus = cpus_per_node
        self.etc = self.root / "etc"
        self.run_dir = self.root / "run"
        self.log_dir = self.root / "log"
        self.pids_file = self.root / "pids"

    # -- paths -------------------------------------------------------------------------
    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.run_dir / "munge" / "munge.socket"

    def env(self) -> Dict[str, str]:
        """The environment Slurm commands need to talk to this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.slurm_conf))

    def node_names(self) -> List[str]:
        return [f"n{i}" for i in range(1, self.nodes + 1)]

    # -- the folder ------------------------------------------------------------------------
    def claim(self) -> bool:
        """Make sure the folder is the cluster's own: create it fresh (True), or accept the one a
        previous cluster of ours left (False: our marker, our owner, mode 0700). Anything else
        raises ClusterError with one line saying what to do."""
        if os.path.lexists(self.root):
            self.token = check_folder(self.root)
            return False
        self.token = create_folder(self.root)
        return True

    # -- pid bookkeeping -------------------------------------------------------------------
    def _pids_header(self) -> str:
        return "# " + _MARKER_LINE.format(self.token)

    def _new_pids_file(self) -> None:
        self.pids_file.write_text(self._pids_header() + "\n", encoding="utf-8")

    def _record(self, label: str, pid: int, exe: str) -> None:
        st = _proc_stat(pid)
        with open(self.pids_file, "a", encoding="utf-8") as f:
            f.write(f"{label} {pid} {st[1] if st else 0} {exe}\n")

    def recorded(self) -> List[Daemon]:
        """The daemons the pid file lists (call once the folder is checked: ``self.token``)."""
        try:
            lines = self.pids_file.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        if not lines:
            return []
        if self.token is None or lines[0] != self._pids_header():
            print(f"test cluster: {self.pids_file} was not written by this folder's cluster; "
                  "no PID in it is signalled", file=sys.stderr)
            return []
        rows = []
        for line in lines[1:]:
            parts = line.split()
            if len(parts) == 4 and parts[1].isdigit() and parts[2].isdigit():
                rows.append(Daemon(parts[0], int(parts[1]), int(parts[2]), parts[3]))
            elif line.strip():
                print(f"test cluster: skipping the unreadable line {line!r} of "
                      f"{self.pids_file}", file=sys.stderr)
        return rows

    def _start(self, name: str, cmd: List[str], env: Optional[Dict[str, str]] = None) -> int:
        log = open(self.log_dir / f"{name}.out", "ab")
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env=env or self.env(), start_new_session=True)
        log.close()
        # Popen returns once the command is exec'd: comm and the start time are the daemon's.
        self._record(name, proc.pid, os.path.basename(cmd[0]))
        return proc.pid

    # -- up ----------------------------------------------------------------------------
    def up(self) -> None:
        fresh = self.claim()  # before anything else: a folder that is not ours is refused
        if not fresh and self.running():
            print(f"test cluster already up in {self.root}: using it as it is (it was started "
                  f"earlier, by another run or session; `down --dir {self.root}` stops it, "
                  f"--dir or HPCADAPT_TESTCLUSTER_DIR gives a cluster of your own)")
            return
        ensure_packages()
        if not fresh:
            self.down(quiet=True)
        for d in (self.etc, self.run_dir / "munge", self.log_dir, self.root / "ctld",
                  self.root / "spool", self.root / "tmp", self.root / "db"):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.run_dir / "munge", 0o755)  # munged refuses a socket folder others can write
        self._new_pids_file()
        try:
            self._start_munge()
            self._start_mariadb()
            self._write_slurm_conf()
            self._start_slurmdbd()
            self._start_slurmctld()
            for node in self.node_names():
                self._start(f"slurmd-{node}", ["slurmd", "-D", "-f", str(self.slurm_conf),
                                                "-N", node])
            self._wait_nodes_idle(60)
        except Exception:
            print(f"test cluster failed to start; logs in {self.log_dir}", file=sys.stderr)
            self.down(quiet=True)
            raise
        (self.root / "env").write_text(f"export SLURM_CONF={self.slurm_conf}\n", encoding="utf-8")
        print(f"test cluster up: {self.nodes} nodes in {self.root}\n"
              f"export SLURM_CONF={self.slurm_conf}", flush=True)

    def munge_key(self) -> Path:
        """The munge key: 1 KiB of random bytes created with mode 0600 (O_EXCL, O_NOFOLLOW), or
        the one a previous cluster of ours left in this checked folder."""
        return _private_file(self.etc / "munge.key", lambda: secrets.token_bytes(1024))

    def _start_munge(self) -> None:
        key = self.munge_key()
        self._start("munged", ["munged", "--foreground", "--force",
                               f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--pid-file={self.run_dir / 'munged.pid'}",
                               f"--log-file={self.log_dir / 'munged.log'}",
                               f"--seed-file={self.run_dir / 'munged.seed'}"])
        _wait_for(lambda: self.munge_socket.exists(), 20, "munged socket")

    def _db_password(self) -> str:
        path = _private_file(self.etc / "db.pass", lambda: secrets.token_hex(16).encode())
        return path.read_text(encoding="utf-8").strip()

    def _start_mariadb(self) -> None:
        datadir = self.root / "db"
        sock = self.run_dir / "mariadb.sock"
        if not (datadir / "mysql").exists():
            _run(["mariadb-install-db", f"--datadir={datadir}", "--user=root",
                  "--auth-root-authentication-method=socket", "--skip-test-db"], timeout=300)
        self._start("mariadb", ["mariadbd", "--no-defaults", f"--datadir={datadir}",
                                f"--socket={sock}", "--bind-address=127.0.0.1",
                                f"--port={PORTS['mariadb']}", "--user=root",
                                f"--pid-file={self.run_dir / 'mariadb.pid'}",
                                f"--log-error={self.log_dir / 'mariadb.log'}",
                                "--innodb-buffer-pool-size=64M", "--skip-name-resolve"])
        _wait_for(lambda: sock.exists() and _port_open(PORTS["mariadb"]), 60, "MariaDB")
        password = self._db_password()
        sql = (f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';"
               f"ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';"
               "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';FLUSH PRIVILEGES;")
        _run(["mariadb", "--no-defaults", f"--socket={sock}", "-u", "root"], input_text=sql)

    def _write_slurm_conf(self) -> None:
        r = self.root
        auth = f"socket={self.munge_socket}"
        first, last = PORTS["slurmd_base"], PORTS["slurmd_base"] + self.nodes - 1
        conf = f"""# hpcadapt test cluster: {self.nodes} emulated nodes on this machine
ClusterName={CLUSTER_NAME}
SlurmctldHost=localhost
SlurmctldPort={PORTS['slurmctld']}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s)
AuthInfo={auth},cred_expire=15
CredType=cred/munge
StateSaveLocation={r / 'ctld'}
SlurmdSpoolDir={r / 'spool'}/%n
SlurmctldPidFile={self.run_dir / 'slurmctld.pid'}
SlurmdPidFile={self.run_dir}/slurmd-%n.pid
SlurmctldLogFile={self.log_dir / 'slurmctld.log'}
SlurmdLogFile={self.log_dir}/slurmd-%n.log
TmpFS={r / 'tmp'}/%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort={PORTS['slurmdbd']}
AccountingStoragePass={auth}
MpiDefault=none
SlurmdParameters=config_overrides
SchedulerParameters=permit_job_expansion
SchedulerType=sched/backfill
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
EnforcePartLimits=ALL
ReturnToService=2
KillWait=10
MinJobAge=300
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
MessageTimeout=10
NodeName=n[1-{self.nodes}] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[{first}-{last}] CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes=n[1-{self.nodes}] Default=YES MaxTime=INFINITE State=UP
# A partition with a limit, to see a request refused: jobs of at most one minute.
PartitionName=short Nodes=n[1-{self.nodes}] MaxTime=1 State=UP
# Preemption as sites run it: a job of the higher tier preempts the others on its nodes,
# which are requeued (their steps and batch shell get SIGTERM, SIGKILL KillWait later).
PartitionName=urgent Nodes=n[1-{self.nodes}] MaxTime=INFINITE PriorityTier=10 PreemptMode=OFF State=UP
# ... and a partition whose preempted jobs are cancelled, not requeued (a scavenger queue).
PartitionName=scavenger Nodes=n[1-{self.nodes}] MaxTime=INFINITE PreemptMode=CANCEL State=UP
"""
        self.slurm_conf.write_text(conf, encoding="utf-8")
        dbd = f"""AuthType=auth/munge
AuthInfo={auth}
DbdHost=localhost
DbdPort={PORTS['slurmdbd']}
SlurmUser=root
PidFile={self.run_dir / 'slurmdbd.pid'}
LogFile={self.log_dir / 'slurmdbd.log'}
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={PORTS['mariadb']}
StorageUser=slurm
StoragePass={self._db_password()}
StorageLoc=slurm_acct_db
"""
        path = self.etc / "slurmdbd.conf"
        path.write_text(dbd, encoding="utf-8")
        os.chmod(path, 0o600)  # slurmdbd refuses a configuration others can read

    def _start_slurmdbd(self) -> None:
        self._start("slurmdbd", ["slurmdbd", "-D"])
        _wait_for(lambda: _port_open(PORTS["slurmdbd"]), 60, "slurmdbd")
        env = self.env()
        if CLUSTER_NAME not in _run(["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster"],
                                    env=env).stdout.split():
            _run(["sacctmgr", "-i", "add", "cluster", CLUSTER_NAME], env=env)

    def _start_slurmctld(self) -> None:
        self._start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.slurm_conf)])
        _wait_for(lambda: _run(["scontrol", "ping"], env=self.env(), check=False,
                               timeout=20).returncode == 0, 60, "slurmctld")
        self._cancel_leftover_jobs()

    def _cancel_leftover_jobs(self) -> None:
        """Cancel the jobs the controller kept from an earlier cluster in this folder (one
        stopped while tests ran): before any node registers, so none of them starts and
        holds a node the new session's tests need."""
        out = _run(["squeue", "-h", "-o", "%i"], env=self.env(), timeout=20).stdout
        left = sorted({line.strip().split("_")[0] for line in out.splitlines() if line.strip()})
        if left:
            print(f"test cluster: cancelling {len(left)} job(s) left from before: "
                  f"{' '.join(left)}", flush=True)
            _run(["scancel"] + left, env=self.env(), timeout=60)

    def _wait_nodes_idle(self, timeout: float) -> None:
        def idle() -> bool:
            out = _run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env(), check=False,
                       timeout=20).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            return len(states) == self.nodes and all(s == "idle" for s in states.values())

        _wait_for(idle, timeout, f"{self.nodes} idle nodes")

    # -- state -------------------------------------------------------------------------
    def running(self) -> bool:
        """Whether the cluster in our own folder is up: every recorded daemon is still the one
        started and slurmctld answers. A folder that is not ours is never up (and not used)."""
        if not os.path.lexists(self.root):
            return False
        try:
            self.token = check_folder(self.root)
        except (ClusterError, OSError):
            return False
        rows = self.recorded()
        if not rows or any(why_not_daemon(d) is not None for d in rows):
            return False
        try:
            return _run(["scontrol", "ping"], env=self.env(), check=False,
                        timeout=20).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    # -- down --------------------------------------------------------------------------
    def down(self, quiet: bool = False) -> None:
        """Stop the daemons recorded in our own folder: each PID is signalled only when /proc
        shows it is still the daemon started (command and start time); any other is skipped
        with a line saying why. A folder that is not ours raises ClusterError (nothing is
        signalled)."""
        if not os.path.lexists(self.root):
            if not quiet:
                print(f"no test cluster in {self.root}")
            return
        self.token = check_folder(self.root)
        rows = []
        for d in self.recorded():
            why = why_not_daemon(d)
            if why is None:
                rows.append(d)
            else:
                print(f"test cluster: not signalling PID {d.pid} ({d.label}): {why}",
                      file=sys.stderr)
        if not rows:
            self._new_pids_file()
            if not quiet:
                print(f"no test cluster running in {self.root}")
            return
        if any(d.label == "slurmctld" for d in rows):
            # End the jobs first so that their step daemons (slurmstepd) exit with them.
            _run(["scancel", "--full", "--state=RUNNING"], env=self.env(), check=False, timeout=30)
            _run(["scancel", "--state=PENDING"], env=self.env(), check=False, timeout=30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and _run(
                    ["squeue", "-h", "-o", "%i"], env=self.env(), check=False,
                    timeout=20).stdout.strip():
                time.sleep(0.5)
        # Stop in the reverse order of start: slurmds, slurmctld, slurmdbd, MariaDB, munged.
        for d in reversed(rows):
            why = stop_daemon(d, timeout=20)
            if why is not None and why != "no such process any more":
                print(f"test cluster: not signalling PID {d.pid} ({d.label}): {why}",
                      file=sys.stderr)
        self._new_pids_file()
        if not quiet:
            print(f"test cluster in {self.root} stopped")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_for(ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    raise ClusterError(f"{what} not ready after {timeout:.0f} s")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["up", "down", "env", "status"])
    p.add_argument("--dir", default=DEFAULT_DIR, help="the cluster's private folder")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--cpus-per-node", type=int, default=2)
    args = p.parse_args(argv)
    cluster = TestCluster(args.dir, args.nodes, args.cpus_per_node)
    try:
        if args.action == "up":
            cluster.up()
        elif args.action == "down":
            cluster.down()
        elif args.action == "env":
            print(f"export SLURM_CONF={cluster.slurm_conf}")
        else:
            if os.path.lexists(cluster.root):
                check_folder(cluster.root)  # a folder not ours: say so, not just "down"
            up = cluster.running()
            print("up" if up else "down")
            return 0 if up else 1
    except (ClusterError, subprocess.TimeoutExpired, OSError) as exc:
        print(f"test cluster: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
