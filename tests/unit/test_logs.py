"""Log lines name who speaks: a rank of the job, or a worker still joining it."""

import logging

from hpcadapt.base.logs import setup_logging


def _line(rank_of, capsys):
    setup_logging(rank_of)
    try:
        logging.getLogger("hpcadapt.test").warning("hello")
        return capsys.readouterr().err.strip()
    finally:
        for name in ("hpcadapt", "py.warnings"):
            logger = logging.getLogger(name)
            for h in list(logger.handlers):
                if getattr(h, "_hpcadapt", False):
                    logger.removeHandler(h)
            logger.propagate = True


def test_a_rank_of_the_job_is_named_by_its_rank(capsys):
    assert _line(lambda: 3, capsys) == "[rank 3] WARNING hpcadapt.test: hello"


def test_a_worker_still_joining_says_so_not_rank_0(capsys):
    assert _line(lambda: "joiner 4242", capsys) == "[joiner 4242] WARNING hpcadapt.test: hello"
