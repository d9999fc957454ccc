"""Every output path is checked at start, the file itself as well as its folder, without
creating, truncating or following it: one line naming the flag instead of a traceback at the
first write or at the job's end."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest

from conftest import ROOT, run_mpi
from hpcadapt.base.paths import unwritable as _unwritable

SCRIPTS = ROOT / "tests" / "scripts"


@pytest.fixture
def read_only_file(tmp_path):
    """A file this process cannot write: mode 0444, or immutable for root (who ignores the
    mode)."""
    path = tmp_path / "out.json"
    path.write_text("keep\n")
    path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    immutable = os.geteuid() == 0
    if immutable:
        chattr = shutil.which("chattr")
        if chattr is None or subprocess.run([chattr, "+i", str(path)]).returncode != 0:
            pytest.skip("root, and no immutable files here")
    yield path
    if immutable:
        subprocess.run([shutil.which("chattr"), "-i", str(path)], check=True)


@pytest.mark.parametrize("flag", ["--summary-json", "--metrics-file"])
def test_a_read_only_file_is_refused_and_left_as_it_was(read_only_file, flag):
    why = _unwritable(flag, str(read_only_file))
    assert why.startswith(f"{flag} {read_only_file}: the file cannot be written"), why
    assert read_only_file.read_text() == "keep\n"


def test_a_checkpoint_is_renamed_over_so_only_its_folder_counts(tmp_path):
    """A checkpoint is written to a temporary file and renamed over PATH (a symlink there is
    replaced, never followed): a read-only file or a link at PATH does not stop it."""
    link = tmp_path / "c.ckpt"
    link.symlink_to(tmp_path / "nowhere")
    assert _unwritable("--checkpoint", str(link), replaced=True) == ""


def test_a_writable_file_passes_and_is_not_truncated(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("row\n")
    assert _unwritable("--metrics-file", str(path)) == ""
    assert path.read_text() == "row\n" and os.listdir(tmp_path) == ["m.jsonl"]


def test_a_missing_file_in_a_writable_folder_passes_and_is_not_created(tmp_path):
    assert _unwritable("--summary-json", str(tmp_path / "s.json")) == ""
    assert os.listdir(tmp_path) == []


def test_a_symbolic_link_is_refused_not_followed(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text("theirs\n")
    link = tmp_path / "s.json"
    link.symlink_to(target)
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "nowhere.json")
    for path in (link, dangling):
        assert "is a symbolic link" in _unwritable("--summary-json", str(path))
    assert target.read_text() == "theirs\n" and not (tmp_path / "nowhere.json").exists()


def test_the_sample_log_must_be_a_writable_folder(tmp_path):
    afile = tmp_path / "f"
    afile.write_text("")
    assert "is not a folder" in _unwritable("--sample-log", str(afile), folder_path=True)
    assert _unwritable("--sample-log", str(tmp_path / "new" / "deeper"), folder_path=True) == ""
    assert not (tmp_path / "new").exists()


def test_a_read_only_summary_file_ends_two_ranks_at_start_in_one_line(read_only_file):
    """It used to pass the start check (the folder was writable) and end the trained job
    with a PermissionError traceback."""
    proc = run_mpi(2, [str(SCRIPTS / "bad_input.py"), "--case", "ok", "--summary-json",
                       str(read_only_file)], check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "the file cannot be written" in line]
    assert len(lines) == 1 and "--summary-json" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
