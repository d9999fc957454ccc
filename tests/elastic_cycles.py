"""Grow/shrink cycles with the elastic machinery itself (no model), for the leak test and
the crashing-joiner test. Run as ``mpiexec -n 1 python tests/elastic_cycles.py``; it starts
its joiners through the local allocator, and a joiner runs this same file with
HPCADAPT_JOIN_DIR in its environment."""

import argparse
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from hpcadapt.base import config
from hpcadapt.elastic.allocator import LocalAllocator
from hpcadapt.elastic.joins import JoinTicket, join_running_job
from hpcadapt.elastic.membership import ABANDON, JOIN, ElasticController, split_leavers
from hpcadapt.comm.world import World


def children_of(pid):
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def rss_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def joiner(args, join_dir):
    if args.crash:
        sys.exit(3)  # dies during start-up, before it is ready
    world = World(MPI.COMM_WORLD.Dup())
    world.replace(join_running_job(JoinTicket.claim(join_dir)))
    x = np.array([1], dtype=np.int64)
    world.comm.Allreduce(MPI.IN_PLACE, x)  # the grown world works
    new = split_leavers(world.comm, [world.rank])  # leave at once
    assert new is None
    world.free()


def wait_for(ctrl, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        status, count, detail = ctrl.poll_grow()
        if status != 0:
            return status, count, detail
        time.sleep(0.02)
    raise SystemExit("grow never completed")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=50)
    ap.add_argument("--crash", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    join_dir = config.take_join_dir()
    if join_dir:
        return joiner(args, join_dir)
    world = World(MPI.COMM_WORLD.Dup())
    alloc = LocalAllocator(2)
    argv = [os.path.abspath(__file__)] + (["--crash"] if args.crash else [])
    ctrl = ElasticController(world, alloc, argv, join_timeout=60)
    samples = []
    outcomes = []
    for cycle in range(args.cycles):
        assert ctrl.start_grow(2, f"cycle {cycle}") is None
        status, count, detail = wait_for(ctrl)
        if status == ABANDON:
            outcomes.append({"cycle": cycle, "abandoned": detail})
            ctrl.abandon(detail)
            x = np.array([1], dtype=np.int64)
            world.comm.Allreduce(MPI.IN_PLACE, x)  # the job still works at its size
            continue
        assert status == JOIN and count == 1
        world.replace(ctrl.join(count))
        x = np.array([1], dtype=np.int64)
        world.comm.Allreduce(MPI.IN_PLACE, x)
        assert x[0] == 2 and world.size == 2
        world.replace(split_leavers(world.comm, [1]))
        assert world.size == 1
        alloc.close()  # waits for the joiner's mpiexec to exit
        samples.append({"cycle": cycle, "fds": len(os.listdir("/proc/self/fd")),
                        "rss_kb": rss_kb(), "children": len(children_of(os.getpid())),
                        "version": world.cluster_version})
        outcomes.append({"cycle": cycle, "joined": True})
    result = {"samples": samples, "outcomes": outcomes, "version": world.cluster_version}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    world.free()


if __name__ == "__main__":
    main()
