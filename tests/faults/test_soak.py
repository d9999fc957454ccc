"""A short soak: about 25 random events (scheduled grows and shrinks, SIGKILLs of joined
workers with replacement, SIGUSR1 stops with a relaunch that resumes) in one job, driven by
tests/drivers/soak.py with a fixed seed. Every wait in the driver is for an event the job
reports, bounded by a deadline; nothing here asserts on timings.

Checked: no hang, exit 75 at each stop and 0 at the stop file, every failure recovered,
replicas identical after every resize, every sample of every finished epoch exactly once, no
process left; fds and children of the original ranks back to their level at the same world
size, RSS growth bounded."""

import pytest

from conftest import repeats, run_soak_driver

pytestmark = pytest.mark.slow

# make test: 10 (seed 3's plan: resizes, kills and a stop). 8 ended on a kill, whose last
# sample caught the killed joiner's launcher still exiting beside its replacement's
# (children +1 at the same size, nothing left at the end): a sampling moment, not a leak; the
# driver now waits for a leaver's whole launcher chain (its proxy and mpiexec) before sampling.
EVENTS = repeats(16, 10)
SEED = 3

# Found by this soak (seed 3) and fixed: the death of joined rank 2 of 4 while it relayed a
# boundary broadcast (the plan's Ibcast, a binomial tree 0 -> 1, 0 -> 2 -> 3) hung the job:
# ranks 0 and 1 had finished the broadcast and met the death in the next step, rank 3 met it in
# the broadcast, recovered inside the policies' hook and went on with the rest of the boundary
# on the new world while ranks 0 and 1 redid the step. A recovery now ends the boundary at once; the
# random-victim test below (kills right after a join too) covers it.


def _soak(tmp_path, events, extra):
    """Run the driver; returns (its JSON result, its output)."""
    result, log = run_soak_driver(tmp_path, [
        "--events", str(events), "--seed", str(SEED), "--resize-weight", "0.4",
        "--kill-weight", "0.4", "--stop-weight", "0.2", "--event-timeout", "100",
        "--start-timeout", "150"] + extra, timeout=1200)
    assert not result.get("left_behind"), result.get("left_behind")
    return result, log


MPICH_CRASH = ("MPICH 5.0.2 crashed (SIGSEGV, exit 11) inside MPI after a peer's death, "
               "before hpcadapt could see it (docs/guides/failures.md: "
               "'Known: MPICH 5.0.2 itself crashes')")


def _check(result, log, events):
    assert not result.get("hangs"), result.get("error", "")[:3000]
    if "(exit 11)" in result.get("error", ""):
        pytest.xfail(f"{MPICH_CRASH}: {result['error'][:300]}")
    assert "error" not in result, result["error"]
    checks = result["checks"]
    for name in ("no_hang", "exit_codes", "every_sample_once", "no_process_left",
                 "all_failures_recovered", "replicas_identical"):
        assert checks[name], (name, log[-3000:])
    kinds = result["events_by_kind"]
    assert result["events"] == events and all(kinds[k] >= 1 for k in ("resize", "kill", "stop"))
    assert result["resumes"] == kinds["stop"]
    kills = result["kills"]
    assert kills["recovered"] + kills["killed_while_leaving"] + kills["gone_before_kill"] \
        == kinds["kill"]
    assert kills["recovered"] >= 1 and result["failures_not_recovered"] == 0
    res = result["resources"]
    leaks = {k: checks[k] for k in ("fds_bounded", "children_bounded", "rss_bounded")}
    assert all(leaks.values()), (
        f"resource growth over the bounds {res['bounds']}: {leaks}, fd growth "
        f"{res['fd_growth_max']}, children growth {res['children_growth_max']}, "
        f"zombies at a launch's last event {res['zombies_last_max']}, a zombie never reaped "
        f"{res['zombies_persisting_max']}, RSS growth {res['rss_growth_mb_max']} MB")


@pytest.mark.timeout(1260)
def test_soak_of_random_events_never_hangs_leaks_or_loses_a_sample(tmp_path):
    """Kills take the highest joined rank, at least 10 steps after the world formed."""
    result, log = _soak(tmp_path, EVENTS, ["--victim", "highest"])
    _check(result, log, EVENTS)


@pytest.mark.timeout(1260)
def test_soak_killing_any_joined_rank_at_any_time(tmp_path):
    """Kills take any joined rank (rank 2 of 4 relays broadcasts to rank 3), also right after
    a join (--kill-after-steps 0): the deaths that found the boundary hang."""
    result, log = _soak(tmp_path, 10, ["--victim", "random", "--kill-after-steps", "0"])
    _check(result, log, 10)
