"""``python -m hpcadapt.agent``: waits for orphaned descendants, returns the job's exit code,
forwards stop signals to the coordinator of the moment, refuses bad commands in one line; and
the metrics file taken over by a new coordinator. Every wait is for a file the child writes."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from conftest import ROOT

from hpcadapt.base.metrics import MetricsSink


def _agent(*command, **kw):
    return subprocess.Popen([sys.executable, "-m", "hpcadapt.agent", *command], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _wait_file(path, proc, timeout=60):
    t0 = time.monotonic()
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate(timeout=60)
        assert time.monotonic() - t0 < timeout, f"no {path}"
        time.sleep(0.01)


def test_exit_code_is_the_first_launchs_without_a_recorded_one():
    proc = _agent(sys.executable, "-c", "import sys; sys.exit(3)")
    assert proc.wait(timeout=60) == 3


def test_exit_code_is_the_one_the_coordinator_recorded():
    code = "from hpcadapt import agent; agent.record_exit_code(7)"
    proc = _agent(sys.executable, "-c", code)
    assert proc.wait(timeout=60) == 7


def test_it_waits_for_an_orphaned_grandchild(tmp_path):
    started, go, done = tmp_path / "started", tmp_path / "go", tmp_path / "done"
    grandchild = textwrap.dedent(f"""
        import os, time
        open({str(started)!r}, "w").close()
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        open({str(done)!r}, "w").close()
    """)
    child = (f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
             f"{grandchild!r}], start_new_session=True)")
    proc = _agent(sys.executable, "-c", child)
    _wait_file(started, proc)
    time.sleep(0.2)  # not a race: the agent must still be waiting whatever the delay
    assert proc.poll() is None, "the agent returned before its orphaned grandchild ended"
    go.write_text("go")
    assert proc.wait(timeout=60) == 0 and done.exists()


def test_a_child_it_had_before_the_launch_is_not_waited_for():
    """`agent ... 2> >(filter) &` in a job script: bash forks the filter, then execs the agent
    in that process, so the filter is the agent's child and ends only when the agent's
    stderr closes. The agent returns when its launch (and what the launch orphaned) ended."""
    script = (f"{sys.executable} -m hpcadapt.agent -- {sys.executable} -c 'import sys; "
              f"sys.exit(7)' 2> >(cat >&2) & wait $!")
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, timeout=120,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.returncode == 7, proc.stderr


def test_stop_signals_go_to_the_recorded_coordinator(tmp_path):
    ready, got = tmp_path / "ready", tmp_path / "got"
    code = textwrap.dedent(f"""
        import os, signal, time
        from hpcadapt import agent
        agent.record_coordinator()
        seen = []
        signal.signal(signal.SIGUSR1, lambda *a: seen.append(1))
        open({str(ready)!r}, "w").close()
        while not seen:
            time.sleep(0.01)
        with open({str(got)!r}, "w") as f:
            f.write(str(agent.stopping()))  # a stop asked of the job: no recovery then
        agent.record_exit_code(75)
    """)
    proc = _agent(sys.executable, "-c", code)
    _wait_file(ready, proc)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=60) == 75 and got.read_text() == "True"


def test_bad_commands_are_refused_in_one_line():
    proc = _agent()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and err.startswith("usage:") and "Traceback" not in err
    proc = _agent("no-such-program-here")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "no-such-program-here" in err, err


def test_a_new_coordinator_takes_over_the_metrics_file(tmp_path):
    path = tmp_path / "m.jsonl"
    first = {"event": "step", "step": 1, "time_s": 2.0, "unix_time": time.time() - 10.0}
    path.write_text(json.dumps(first) + "\n" + json.dumps({"event": "step", "step": 2}) +
                    "\n" + '{"event": "st')  # the dead coordinator's half-written line
    sink = MetricsSink.take_over(str(path))
    sink.write({"event": "failure", "step": 2})
    sink.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in rows] == ["step", "step", "failure"]
    # the time axis goes on from the first record's start: about 12 s in, not 0
    assert 11.0 < rows[-1]["time_s"] < 60.0, rows[-1]


def test_a_metrics_file_that_is_a_symlink_is_not_taken_over(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    link = tmp_path / "m.jsonl"
    link.symlink_to(target)
    sink = MetricsSink.take_over(str(link))
    sink.write({"event": "failure"})  # dropped: no file
    sink.close()
    assert target.read_text() == "keep\n"


def test_a_started_training_that_records_no_end_is_not_a_success():
    """A coordinator said the training started, then the launch ended with 0 and no recorded
    exit code (mpirun torn down from outside: Slurm signalled its daemons): 75, so that the
    job script requeues, never 0. A command that is no training keeps its own code."""
    code = "from hpcadapt import agent; agent.record_coordinator()"
    proc = _agent(sys.executable, "-c", code)
    assert proc.wait(timeout=60) == 75
    assert "the launch ended without the training's end" in proc.stderr.read()
    assert _agent(sys.executable, "-c", "pass").wait(timeout=60) == 0
