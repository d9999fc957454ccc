"""The known-issues page must not contradict the code: a flag it calls missing ("no
`--warm-spares` yet" was written while the flag worked and was tested) must be absent from
the CLI, and every hpcadapt flag it names must exist."""

import re

from conftest import ROOT
from hpcadapt.train import build_parser

KNOWN_ISSUES = (ROOT / "docs" / "development" / "known-issues.md").read_text(encoding="utf-8")
# Flags of other programs the page may name (Slurm's sbatch, Open MPI's mpirun).
FOREIGN = {"--time", "--signal", "--with-ft", "--oversubscribe", "--mca",
           "--allow-run-as-root"}


def _cli_flags():
    return set(build_parser()._option_string_actions)


def test_no_flag_is_called_missing_while_the_cli_has_it():
    missing = re.findall(r"\bno `(--[a-z0-9-]+)`", KNOWN_ISSUES)
    present = sorted(set(missing) & _cli_flags())
    assert not present, f"known-issues.md says these are missing, yet the CLI has them: {present}"


def test_every_flag_the_page_names_exists():
    named = set(re.findall(r"`(--[a-z0-9-]+)", KNOWN_ISSUES))
    stale = sorted(named - _cli_flags() - FOREIGN)
    assert not stale, f"known-issues.md names flags the CLI does not have: {stale}"
