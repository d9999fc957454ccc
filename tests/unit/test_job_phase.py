"""Issue 45, one phase: the Job's life is one value (``hpcadapt.loop.phase``) that the
membership and the stops move and the loop reads; no collaborator keeps a flag of its own
for it."""

import ast
import os

import pytest

from conftest import ROOT
from hpcadapt.loop.phase import TRANSITIONS, JobPhase, Phase


def test_a_worker_of_the_launch_trains_and_a_joiner_holds_no_state_until_it_joined():
    launch = JobPhase(joining=False)
    assert launch.phase is Phase.TRAINING and launch.holds_state and not launch.over
    joiner = JobPhase(joining=True)
    assert joiner.phase is Phase.JOINING and not joiner.holds_state and not joiner.over
    joiner.took_state()
    assert joiner.phase is Phase.TRAINING and joiner.holds_state
    joiner.took_state()  # a recovery later hands it the agreed state again: no change
    assert joiner.phase is Phase.TRAINING


def test_each_end_is_over_and_says_why():
    left = JobPhase(joining=False)
    left.leave()
    assert left.over and left.left and left.stopped is None and not left.finished_by_stop_file

    finished = JobPhase(joining=False)
    finished.finish("the stop file")
    assert finished.over and finished.finished_by_stop_file and finished.stopped is None

    stopped = JobPhase(joining=False)
    stopped.stop("SIGUSR1")
    assert stopped.over and stopped.stopped == "SIGUSR1" and stopped.saved
    stopped.not_saved()  # rank 0's word: the save failed
    assert stopped.stopped == "SIGUSR1; state NOT saved" and not stopped.saved

    diverged = JobPhase(joining=False)
    diverged.stop("5 steps with a non-finite loss", saved=False)
    assert diverged.stopped == "5 steps with a non-finite loss; state NOT saved"


def test_a_failure_after_the_stop_file_is_a_stop_and_a_joiner_stopped_holds_no_state():
    p = JobPhase(joining=False)
    p.finish("the stop file")
    p.stop("peer failure")
    assert p.stopped == "peer failure" and not p.finished_by_stop_file
    joiner = JobPhase(joining=True)
    joiner.stop("SIGTERM")
    assert joiner.over and not joiner.holds_state


@pytest.mark.parametrize("start", list(Phase))
def test_every_transition_outside_the_table_is_refused(start):
    moves = {Phase.TRAINING: lambda p: p.took_state() if p.phase is Phase.JOINING
             else p._move(Phase.TRAINING),
             Phase.FINISHED: lambda p: p.finish("stop file"),
             Phase.STOPPED: lambda p: p.stop("x"),
             Phase.LEFT: lambda p: p.leave(),
             Phase.JOINING: lambda p: p._move(Phase.JOINING)}
    for to, move in moves.items():
        p = JobPhase(joining=start is Phase.JOINING)
        p.phase = start
        if to in TRANSITIONS[start]:
            move(p)
            assert p.phase is to
        else:
            with pytest.raises(RuntimeError, match="cannot go from"):
                move(p)
            assert p.phase is start
    assert Phase.JOINING not in set().union(*TRANSITIONS.values())  # nobody joins again
    assert TRANSITIONS[Phase.LEFT] == frozenset()


_PHASE_FLAGS = {"left", "stopped", "by_stop_file", "holds_state", "finished_by_stop_file"}


def test_no_module_of_the_loop_keeps_a_phase_flag_of_its_own():
    """The flags the phase replaced are not assigned anywhere in hpcadapt/ (outside
    loop/phase.py), and Job._over reads the phase."""
    written = []
    for folder, _, files in os.walk(os.path.join(ROOT, "hpcadapt")):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path.endswith(os.path.join("loop", "phase.py")):
                continue
            tree = ast.parse(open(path, encoding="utf-8").read())
            for node in ast.walk(tree):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr in _PHASE_FLAGS:
                        written.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {t.attr}")
    assert written == []
    job = open(os.path.join(ROOT, "hpcadapt", "job.py"), encoding="utf-8").read()
    over = job[job.index("def _over"):].split("\n\n")[0]
    assert "self.phase.over" in over
