import subprocess
import sys

import pytest

from conftest import ROOT
from hpcadapt.train import build_parser


def parse_error(args, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(args)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_defaults_parse():
    a = build_parser().parse_args([])
    assert (a.model, a.dataset, a.batch_size) == ("mlp", "digits", 32)


def test_unknown_model_lists_choices(capsys):
    err = parse_error(["--model", "vgg"], capsys)
    assert "invalid choice: 'vgg'" in err and "cnn" in err and "resnet" in err


def test_unknown_dataset_lists_choices(capsys):
    err = parse_error(["--dataset", "mnist"], capsys)
    assert "digits" in err and "synthetic" in err


@pytest.mark.parametrize("flag,value,words", [
    ("--batch-size", "0", "positive"), ("--epochs", "-1", "positive"),
    ("--lr", "nan", "positive finite"), ("--momentum", "1.5", "[0, 1)"),
    ("--hidden", "10,x", "integers"),
    ("--stop-signals", "USR1,NOPE", "unknown signal 'NOPE'"),
    ("--slurm-mpi", "openmpi", "invalid choice"), ("--allocator", "k8s", "invalid choice"),
    ("--weight-decay", "-5", "0 or a positive finite"), ("--weight-decay", "nan", "0 or a positive"),
    ("--seed", "-1", "[0, 2**32)"), ("--threads", "-3", "must be >= 0"),
    ("--stop-signals", "KILL", "SIGKILL cannot be a stop signal"),
    ("--stop-signals", "CHLD", "SIGCHLD cannot be a stop signal"),
    ("--max-nonfinite-steps", "0", "positive"),
    ("--strategy", "async", "invalid choice: 'async' (choose from 'ssgd', 'sma', "),
    ("--sma-alpha", "0", "(0, 1]"), ("--sma-alpha", "1.5", "(0, 1]"),
    ("--local-sgd-period", "0", "positive"), ("--slow-compute", "0.5", "1 or more"),
    ("--slow-comm", "nan", "1 or more"), ("--slow-rank", "-1", "must be >= 0"),
    ("--topology", "star", "invalid choice: 'star'"), ("--ranks-per-node", "0", ">= 1"),
])
def test_bad_values_name_the_rule(capsys, flag, value, words):
    err = parse_error([flag, value], capsys)
    assert flag in err and words in err


def test_help_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "hpcadapt.train", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--metrics-file" in out.stdout


def test_help_starts_with_examples_that_parse_and_a_short_usage():
    """Issue 43: --help was 538 lines with no examples, and 110 of usage first. Now: a
    two-line usage, then examples, each a command the parser takes as written; the long
    list still follows, by area."""
    import shlex

    from hpcadapt.train import build_parser

    text = build_parser().format_help()
    head = text.split("options:")[0].splitlines()
    assert head[0].startswith("usage: mpiexec -n N python -m hpcadapt.train") and len(head) < 30
    commands = [line.split("$ ", 1)[1] for line in head if line.strip().startswith("$ ")]
    assert len(commands) >= 5
    for command in commands:
        words = shlex.split(command)
        assert words[:5] == ["mpiexec", "-n", "2", "python", "-m"], command
        build_parser().parse_args(words[6:])  # exits 2 on a flag it does not take
    for area in ("training:", "policy gns-batch:", "elastic workers:", "output:"):
        assert f"\n{area}\n" in text


@pytest.mark.parametrize("flags,words", [
    (["--max-workers", "2", "--initial-workers", "3"], "--initial-workers 3 is above --max-workers 2"),
    (["--initial-workers", "3"], "--initial-workers needs --max-workers"),
])
def test_initial_workers_that_cannot_be_started_are_refused_in_one_line(flags, words):
    proc = subprocess.run([sys.executable, "-m", "hpcadapt.train", "--epochs", "1",
                           "--no-progress"] + flags, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert words in proc.stderr and "Traceback" not in proc.stderr


def _cuda_usable():
    from hpcadapt.cuda.device import gpu_problems

    return not gpu_problems()


@pytest.mark.skipif(_cuda_usable(), reason="a GPU with CuPy and NCCL is here")
def test_device_cuda_without_a_gpu_says_what_is_missing_on_two_ranks_and_ends(tmp_path):
    """Every rank ends at once with exit 2; rank 0 prints the one line (what is missing and
    how to install the extra), nobody a traceback."""
    from conftest import mpiexec

    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "hpcadapt.train",
                           "--epochs", "1", "--no-progress", "--device", "cuda"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    err = proc.stderr
    assert proc.returncode == 2, err[-2000:]
    lines = [line for line in err.splitlines() if "--device cuda" in line]
    assert len(lines) == 1 and 'pip install "hpcadapt[cuda]"' in lines[0], err[-2000:]
    assert "no GPU is visible" in lines[0] and "Traceback" not in err


def test_data_plane_nccl_for_a_model_on_the_cpu_is_refused_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "hpcadapt.train", "--epochs", "1",
                           "--no-progress", "--device", "cpu", "--data-plane", "nccl"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "'nccl' carries CUDA tensors" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("program", [["-m", "hpcadapt.train"],
                                     [str(ROOT / "tests" / "scripts" / "fail_on_rank1.py")]])
def test_an_unknown_flag_on_two_ranks_is_named_once_with_where_the_flags_are(program):
    """Every rank parses the same command line; only the first says what is wrong (not the
    whole usage text N times), on hpcadapt's CLI and on a user's parser that
    hpcadapt.add_arguments extended; every rank exits with 2."""
    from conftest import mpiexec

    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable] + program + ["--no-such-flag"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) <= 6, lines
    assert sum("--no-such-flag" in line for line in lines) == 1, lines
    assert any("--help" in line for line in lines), lines


@pytest.mark.parametrize("flags,words", [
    (["--max-workers", "2"], "--max-workers 2 is below the 3 workers already running"),
    (["--min-workers", "4", "--max-workers", "4"], "--min-workers 4 is above the 3 workers"),
    (["--initial-workers", "5", "--max-workers", "4"], "--initial-workers 5 is above"),
    (["--min-workers", "3", "--max-workers", "2"], "--max-workers 2 is below"),
    (["--checkpoint-every", "5"], "--checkpoint-every 5 needs --checkpoint FILE"),
    (["--warm-spares", "1"], "--warm-spares needs --max-workers"),
    (["--policy", "autoscale"], "--policy autoscale resizes the job and needs --max-workers"),
])
def test_worker_count_refusals_on_three_ranks_are_one_line_printed_once(flags, words):
    """Every rank checks the same flags; rank 0 alone says what is wrong, every rank ends
    with 2: no 'aborting all' and no MPI_Abort banner."""
    from conftest import mpiexec

    proc = subprocess.run([mpiexec(), "-n", "3", sys.executable, "-m", "hpcadapt.train",
                           "--epochs", "1", "--no-progress"] + flags, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2, lines
    assert len(lines) == 1 and words in lines[0], lines


def _refusal(flags):
    from hpcadapt.args import refuse_inconsistent
    from hpcadapt.base.options import JobOptions
    from hpcadapt.policies import build_policies

    args = build_parser().parse_args(flags)
    policies = build_policies(args) if args.policy else []
    return refuse_inconsistent(JobOptions.from_args(args, policies=policies))


@pytest.mark.parametrize("flags,words", [
    (["--min-workers", "3"], "--min-workers 3 needs --max-workers"),
    (["--policy", "resize-schedule", "--resize-schedule-steps", "5:3"],
     "--policy resize-schedule resizes the job and needs --max-workers"),
    (["--policy", "autoscale"], "--policy autoscale resizes the job and needs --max-workers"),
    (["--checkpoint-every", "10"], "--checkpoint-every 10 needs --checkpoint FILE"),
    (["--policy", "straggler"], "--policy straggler resizes the job and needs --max-workers"),
    (["--max-workers", "3", "--max-steps", "20", "--policy", "resize-schedule",
      "--resize-schedule-steps", "5:3,50:2"],
     "--resize-schedule-steps 50:2: step 50 is beyond --max-steps 20"),
])
def test_flags_unusable_together_are_refused_in_one_line(flags, words):
    assert words in _refusal(flags)


@pytest.mark.parametrize("flags", [
    [], ["--min-workers", "2", "--max-workers", "3"], ["--policy", "gns-batch"],
    ["--max-workers", "3", "--max-steps", "20", "--policy", "resize-schedule",
     "--resize-schedule-steps", "5:3,20:2"],
])
def test_flags_usable_together_pass(flags):
    assert _refusal(flags) == ""


@pytest.mark.parametrize("value", ["0", "-0.1", "inf"])
def test_a_learning_rate_that_cannot_train_is_refused(capsys, value):
    err = parse_error([f"--lr={value}"], capsys)
    assert "--lr" in err and "positive finite" in err and "Traceback" not in err
