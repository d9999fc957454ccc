#!/usr/bin/env python3
"""A real Slurm cluster on this one machine, for tests, CI and the Slurm quick start.

munge, MariaDB, slurmdbd, slurmctld and one slurmd per emulated node (n1..n4), every file
(configuration, state, logs, pid files, sockets) under one private folder. Daemons run in
the foreground as children of nothing (their own sessions) and are stopped by the PIDs
recorded at start, never by name. Missing packages are installed from Debian's registry.

    python3 slurm/testcluster/cluster.py up [--dir DIR] [--nodes 4]
    python3 slurm/testcluster/cluster.py down [--dir DIR]
    python3 slurm/testcluster/cluster.py env [--dir DIR]   # prints export SLURM_CONF=...

It stands alone (standard library only) so that it runs before hpcadapt is installed."""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

DEFAULT_DIR = os.environ.get("HPCADAPT_TESTCLUSTER_DIR", "/tmp/hpcadapt-slurm")
CLUSTER_NAME = "hpcadapt"
PACKAGES = {"slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sbatch": "slurm-client",
            "slurmdbd": "slurmdbd", "munged": "munge", "mariadbd": "mariadb-server"}
PORTS = {"slurmctld": 16817, "slurmdbd": 16819, "mariadb": 16306, "slurmd_base": 17001}


class ClusterError(RuntimeError):
    pass


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
        self.root = Path(root).resolve()
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

    # -- pid bookkeeping -------------------------------------------------------------------
    def _record(self, name: str, pid: int) -> None:
        with open(self.pids_file, "a", encoding="utf-8") as f:
            f.write(f"{name} {pid}\n")

    def recorded(self) -> List[tuple]:
        if not self.pids_file.exists():
            return []
        rows = []
        for line in self.pids_file.read_text(encoding="utf-8").splitlines():
            name, _, pid = line.partition(" ")
            if pid.strip().isdigit():
                rows.append((name, int(pid)))
        return rows

    def _start(self, name: str, cmd: List[str], env: Optional[Dict[str, str]] = None) -> int:
        log = open(self.log_dir / f"{name}.out", "ab")
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env=env or self.env(), start_new_session=True)
        log.close()
        self._record(name, proc.pid)
        return proc.pid

    # -- up ----------------------------------------------------------------------------
    def up(self) -> None:
        if self.running():
            print(f"test cluster already up in {self.root}")
            return
        ensure_packages()
        self.down(quiet=True)
        for d in (self.etc, self.run_dir / "munge", self.log_dir, self.root / "ctld",
                  self.root / "spool", self.root / "tmp", self.root / "db"):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run_dir / "munge", 0o755)  # munged refuses a socket folder others can write
        self.pids_file.write_text("", encoding="utf-8")
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

    def _start_munge(self) -> None:
        key = self.etc / "munge.key"
        if not key.exists():
            key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o600)
        self._start("munged", ["munged", "--foreground", "--force",
                               f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--pid-file={self.run_dir / 'munged.pid'}",
                               f"--log-file={self.log_dir / 'munged.log'}",
                               f"--seed-file={self.run_dir / 'munged.seed'}"])
        _wait_for(lambda: self.munge_socket.exists(), 20, "munged socket")

    def _db_password(self) -> str:
        path = self.etc / "db.pass"
        if not path.exists():
            path.write_text(secrets.token_hex(16), encoding="utf-8")
            os.chmod(path, 0o600)
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

    def _wait_nodes_idle(self, timeout: float) -> None:
        def idle() -> bool:
            out = _run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env(), check=False,
                       timeout=20).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            return len(states) == self.nodes and all(s == "idle" for s in states.values())

        _wait_for(idle, timeout, f"{self.nodes} idle nodes")

    # -- state -------------------------------------------------------------------------
    def running(self) -> bool:
        rows = self.recorded()
        if not rows or not all(_alive(pid) for _, pid in rows):
            return False
        try:
            return _run(["scontrol", "ping"], env=self.env(), check=False,
                        timeout=20).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    # -- down --------------------------------------------------------------------------
    def down(self, quiet: bool = False) -> None:
        rows = self.recorded()
        if not rows:
            if not quiet:
                print(f"no test cluster recorded in {self.root}")
            return
        names = [n for n, _ in rows]
        if "slurmctld" in names and _alive(dict(rows)["slurmctld"]):
            # End the jobs first so that their step daemons (slurmstepd) exit with them.
            _run(["scancel", "--full", "--state=RUNNING"], env=self.env(), check=False, timeout=30)
            _run(["scancel", "--state=PENDING"], env=self.env(), check=False, timeout=30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and _run(
                    ["squeue", "-h", "-o", "%i"], env=self.env(), check=False,
                    timeout=20).stdout.strip():
                time.sleep(0.5)
        # Stop in the reverse order of start: slurmds, slurmctld, slurmdbd, MariaDB, munged.
        for name, pid in reversed(rows):
            _stop(pid, timeout=20)
        self.pids_file.write_text("", encoding="utf-8")
        if not quiet:
            print(f"test cluster in {self.root} stopped")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not alive; /proc tells.
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _stop(pid: int, timeout: float) -> None:
    if not _alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


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
            up = cluster.running()
            print("up" if up else "down")
            return 0 if up else 1
    except (ClusterError, subprocess.TimeoutExpired, OSError) as exc:
        print(f"test cluster: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
