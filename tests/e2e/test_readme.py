"""The user-script guide, docs/guides/own-script.md ("Your own training script", linked from
the README), followed literally: its script is saved under the name it gives, and its commands
run as written (with `python` and `mpiexec` the ones of this test run) on real MPI ranks."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from conftest import ROOT, complete_rows, mpiexec, reap_on_teardown, wait_for

GUIDE = (ROOT / "docs" / "guides" / "own-script.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    """The page from its heading `# {title}` (any level) to the next heading of that level or
    above outside code blocks (a script's `# comment` is no heading), or to the page's end:
    the whole guide for its own title."""
    lines, fenced, start, level = GUIDE.split("\n"), False, None, 0
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
            continue
        heading = None if fenced else re.match(r"(#+) (.*)$", line)
        if heading and start is None and heading.group(2) == title:
            start, level = i, len(heading.group(1))
        elif heading and start is not None and len(heading.group(1)) <= level:
            return "\n".join(lines[start:i])
    assert start is not None, f"no heading {title!r} in docs/guides/own-script.md"
    return "\n".join(lines[start:])


def _blocks(text: str) -> List[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


SECTION = _section("Your own training script")
SCRIPTS = {b.splitlines()[0].split()[-1]: b for b in _blocks(SECTION) if b.startswith("# file: ")}
SCRIPT_NAME, SCRIPT = next(iter(SCRIPTS.items()))
COMMANDS = [line for b in _blocks(SECTION) if not b.startswith("# file: ")
            for line in b.splitlines() if line.startswith(("mpiexec ", "python "))]


def _argv(command: str) -> List[str]:
    words = shlex.split(command)
    out = []
    for w in words:
        out.append(mpiexec() if w == "mpiexec" else sys.executable if w == "python" else w)
    return out


def _command(fragment: str) -> List[str]:
    found = [c for c in COMMANDS if fragment in c]
    assert len(found) == 1, (fragment, COMMANDS)
    return _argv(found[0])


def _summary(stdout: str) -> dict:
    lines = [l for l in stdout.splitlines() if l.startswith("{")]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("readme")
    for name, text in SCRIPTS.items():
        (d / name).write_text(text, encoding="utf-8")
    return d


def _run(argv: List[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_the_readme_names_its_script_and_every_command_uses_it():
    assert SCRIPT_NAME == "train_mine.py" and "train_growth.py" in SCRIPTS
    assert len(COMMANDS) >= 6
    assert all(any(name in c for name in SCRIPTS) or c.startswith("python -m hpcadapt.plot")
               for c in COMMANDS)


@pytest.mark.slow
def test_growth_instead_of_decay(folder):
    """The guide's growth script and command: the cosine's decay becomes growth of the batch
    in steps of sqrt(2), each a decision of decay-growth, and it trains to the end."""
    proc = _run(_command("train_growth.py"), folder)
    s = _summary(proc.stdout)
    assert s["epochs"] == 10 and s["stopped"] is None and s["final_test_accuracy"] > 0.3
    rows = [json.loads(l) for l in (folder / "growth.jsonl").read_text().splitlines()]
    grew = [r for r in rows if r["event"] == "decision" and r["policy"] == "decay-growth"]
    assert grew and all("of its peak becomes batch" in r["reason"] for r in grew)
    assert s["batch_size"] == round(16 * 1.4142 ** len(grew))


@pytest.mark.slow
def test_plain_and_adaptive_runs_and_the_plot(folder):
    plain = _run(_argv(COMMANDS[0]), folder)  # the first: plain data-parallel
    s = _summary(plain.stdout)
    assert s["epochs"] == 3 and s["world_size"] == 2 and s["final_test_accuracy"] > 0.3
    adaptive = _run(_command("--policy gns-batch"), folder)
    assert "policies: gns-batch" in adaptive.stderr
    rows = [json.loads(l) for l in (folder / "run.jsonl").read_text().splitlines()]
    assert sum(1 for r in rows if r["event"] == "step") == _summary(adaptive.stdout)["steps"]
    _run(_command("hpcadapt.plot"), folder)
    assert (folder / "run.png").stat().st_size > 10_000


@pytest.mark.slow
def test_the_elastic_command_grows_and_shrinks(folder):
    """The guide's command, trained until told (a joiner needs seconds to start however
    fast the steps are): a stop file ends it once both resizes are done."""
    stop, metrics = folder / "stop-elastic", folder / "elastic.jsonl"
    argv = _command("--max-workers 3") + ["--epochs", "1000", "--stop-file", str(stop),
                                          "--metrics-file", str(metrics), "--check-replicas"]
    with open(folder / "elastic.err", "w") as err:
        proc = subprocess.Popen(argv, cwd=folder, stdout=subprocess.DEVNULL, stderr=err)
        reap_on_teardown(proc, str(metrics))

        def two_resizes():
            rows = [r for r in complete_rows(metrics) if r["event"] == "resize"]
            return rows if len(rows) >= 2 else None

        resizes = wait_for(two_resizes, "two resizes", proc, stderr=folder / "elastic.err")
        stop.touch()
        rc = proc.wait(timeout=600)
    log = (folder / "elastic.err").read_text()
    assert rc == 0, log[-4000:]
    assert [(r["old_size"], r["new_size"], r["ok"], r["replicas_identical"])
            for r in resizes] == [(2, 3, True, True), (3, 2, True, True)], log[-4000:]
    assert "joined as rank 2 of 3" in log


@pytest.mark.slow
def test_the_checkpoint_command_stops_on_usr1_and_resumes(folder):
    """USR1 to mpiexec (MPICH's forwards it to the ranks) once the run reports step 5; the
    same command again resumes and, trained to the end, removes its checkpoint."""
    metrics = folder / "ckpt.jsonl"
    argv = _command("--checkpoint") + ["--epochs", "1000"]
    with open(folder / "ckpt.out", "w") as out, open(folder / "ckpt.err", "w") as err:
        proc = subprocess.Popen(argv + ["--metrics-file", str(metrics)], cwd=folder,
                                stdout=out, stderr=err)
        reap_on_teardown(proc, str(metrics))
        wait_for(lambda: metrics.exists() and metrics.read_text().count('"event": "step"') >= 5,
                 "step 5", proc, stderr=folder / "ckpt.err")
        proc.send_signal(signal.SIGUSR1)
        rc = proc.wait(timeout=600)
    assert rc == 75, (folder / "ckpt.err").read_text()[-4000:]
    stopped = _summary((folder / "ckpt.out").read_text())
    assert stopped["stopped"] == "SIGUSR1" and (folder / "state.ckpt").exists()
    again = _run(argv + ["--max-steps", str(stopped["steps"] + 20)], folder)
    assert f"resumed from state.ckpt at epoch {stopped['epochs']}, step {stopped['steps']}" \
        in again.stderr
    assert _summary(again.stdout)["steps"] == stopped["steps"] + 20
    assert not (folder / "state.ckpt").exists()


@pytest.mark.slow
def test_the_strategy_command_trains_in_bounded_delay_rounds(folder):
    proc = _run(_command("--strategy bounded-delay"), folder)
    s = _summary(proc.stdout)
    assert s["strategy"] == "bounded-delay" and s["epochs"] == 3
    assert s["bounded_delay"]["rounds"] >= 3 and s["bounded_delay"]["applied_updates"] > 0
    assert "strategy bounded-delay" in proc.stderr


README = (ROOT / "README.md").read_text(encoding="utf-8")


def _block_after(text: str, marker: str) -> str:
    """The first fenced code block after ``marker`` in ``text``."""
    rest = text[text.index(marker):]
    start = rest.index("```\n") + 4
    return rest[start:rest.index("```", start)]


@pytest.mark.skipif(Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(),
                    reason="the README's environment is .venv (run once, in the MPICH phase)")
def test_the_readmes_commands_run_as_written_in_a_fresh_shell(tmp_path):
    """Issue 43: in a fresh shell the README's `mpiexec -n 2 python ...` said `mpiexec: command
    not found` (nothing said to enter .venv). A shell with the system's PATH only, the
    README's own line that enters the environment, then its "same run by hand" commands as
    written: the run trains, grows and shrinks, and the plot is written."""
    enter = _block_after(README, "enter it once per shell")
    assert enter.startswith("source .venv/bin/activate")
    commands = _block_after(README, "the same run by hand")
    script = f"set -e\ncd {shlex.quote(str(ROOT))}\n{enter}cd {shlex.quote(str(tmp_path))}\n" \
             f"{commands}"
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "TMPDIR": str(tmp_path)}
    proc = subprocess.run(["bash", "--noprofile", "--norc", "-c", script], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plot written to" in proc.stdout and (tmp_path / "demo.png").exists()
    rows = complete_rows(tmp_path / "demo-metrics.jsonl")
    assert {r["world_size"] for r in rows if r.get("event") == "step"} >= {2, 3}
