"""What ``Job`` checks and chooses as it starts: the device of this rank, the data plane for
the model's gradients, the output paths, and rank 0's verdict told to every rank so that all
stop together. Functions of what they are given (the options, the world), no job state."""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from hpcadapt.base.errors import ConfigurationError, on_every_rank
from hpcadapt.base.options import RESIZING_POLICIES, JobOptions
from hpcadapt.base.paths import unwritable
from hpcadapt.comm.tell import root_tells

__all__ = ["choose_device", "data_plane", "agree", "check_output_folders", "say_once",
           "schedule_for_policies"]

log = logging.getLogger("hpcadapt.job")


def choose_device(options: JobOptions, world):
    """--device: this rank's device from its local rank (one GPU per rank; ranks share
    GPUs, over the host-staged plane, when a node has more ranks than GPUs)."""
    from hpcadapt.cuda.device import choose_device as choose

    choice, error = None, ""
    try:
        choice = choose(options.comm.device, local_rank=world.local_rank,
                        local_size=world.local_size)
    except ConfigurationError as exc:
        error = str(exc)
    agree(error, world)  # rank 0's problem: raised on every rank together, printed once
    if choice is None:
        raise ConfigurationError(error)  # this rank's alone: the job ends (exception hook)
    if choice.kind == "cuda":
        torch.cuda.set_device(choice.index)
    return choice


def data_plane(model: nn.Module, options: JobOptions, device: torch.device,
               device_choice) -> str:
    """The plane for ``model``'s gradients; ConfigurationError when the model is not on the
    device the job trains on (``--device`` asked explicitly)."""
    params = [p for p in model.parameters()]
    where = params[0].device if params else torch.device("cpu")
    if options.comm.device != "auto" and where.type != device.type:
        raise ConfigurationError(
            f"the model is on {where} but --device {options.comm.device} trains on {device}: "
            f"call model.to(job.device) before job.setup")
    if options.comm.data_plane == "auto" and where.type == "cuda":
        return device_choice.data_plane if device_choice.kind == "cuda" else "auto"
    return options.comm.data_plane


def agree(error: str, world) -> None:
    """Rank 0's verdict for everyone: ConfigurationError on every rank if it is one."""
    error = root_tells(error or None, world, what="rank 0's verdict")
    if error:
        raise on_every_rank(ConfigurationError(error))


def check_output_folders(options: JobOptions, world) -> None:
    """Refuse at start (not at the first write, nor when the stop signal comes) an output
    path that cannot be written, itself or its folder: rank 0 probes, every rank hears its
    verdict."""
    o = options
    error = ""
    if world.rank == 0:
        for flag, path in (("--checkpoint", o.stops.checkpoint),
                           ("--metrics-file", o.recording.metrics_file),
                           ("--summary-json", o.recording.summary_json)):
            if path and not error:
                error = unwritable(flag, path, replaced=flag == "--checkpoint")
        if o.recording.sample_log and not error:
            error = unwritable("--sample-log", o.recording.sample_log, folder_path=True)
    agree(error, world)


def say_once(world, message: str, *args: Any) -> None:
    """A warning every rank reaches alike, printed by rank 0."""
    if world.rank == 0:
        log.warning(message, *args)


def step_scheduler_under_a_batch_policy(optimizer: Any, policies: Sequence[Any],
                                        resize_batch: str, world) -> None:
    """A torch scheduler on ``optimizer`` (it set ``initial_lr`` in the groups) that is not
    wrapped in ``hpcadapt.ProgressLR``, under a policy that changes the global batch: its
    arithmetic counts steps, which the batch changes stretch or shrink (OneCycleLR over
    ``epochs * len(loader)`` ended inside its warm-up). Said once, at setup."""
    changers = [f"--policy {p.name}" for p in policies if getattr(p, "changes_batch", False)]
    if resize_batch == "keep-local":
        changers += [f"--policy {p.name} under --resize-batch keep-local" for p in policies
                     if p.name in RESIZING_POLICIES]
    groups = getattr(optimizer, "param_groups", [])
    if not changers or not any("initial_lr" in g for g in groups) \
            or getattr(optimizer, "_hpcadapt_progress_lr", False):
        return
    say_once(world, "your optimizer has a learning-rate scheduler that counts steps, and %s "
             "changes the global batch: the schedule will end early (a larger batch takes "
             "fewer steps) or late; wrap it as hpcadapt.ProgressLR(scheduler, job), which "
             "steps it by samples seen, and register it in job.setup(extra=...) (see "
             "docs/guides/own-script.md)", changers[0])


def schedule_for_policies(extra: Mapping[str, Any], policies: Sequence[Any], world) -> None:
    """A policy that follows the user's scheduler (``reads_schedule``: decay-growth) needs one
    keyed on samples: a step-keyed scheduler is refused (the batch growth would stretch its
    decay), and a run without a registered scheduler is told that there is nothing to follow.
    Raises ConfigurationError saying what to pass."""
    from hpcadapt.loop.progress import ProgressLR

    readers = [p.name for p in policies if getattr(p, "reads_schedule", False)]
    if not readers:
        return
    schedulers = [(k, v) for k, v in extra.items()
                  if isinstance(v, ProgressLR) or (hasattr(v, "get_last_lr")
                                                   and hasattr(v, "step"))]
    for key, sched in schedulers:
        if not isinstance(sched, ProgressLR):
            raise on_every_rank(ConfigurationError(
                f"--policy {readers[0]} follows your learning-rate scheduler "
                f"(extra[{key!r}], {type(sched).__name__}), which counts steps: the batch it "
                f"grows would stretch the decay; wrap it as hpcadapt.ProgressLR(scheduler, "
                f"job) and step that after each job.step (see docs/guides/own-script.md)"))
    if not schedulers:
        say_once(world, "--policy %s found no learning-rate scheduler in job.setup(extra=...): "
                 "it turns the schedule's decay into batch growth, and a constant rate has "
                 "none; register your hpcadapt.ProgressLR as extra={'scheduler': ...} (or "
                 "pass --lr-schedule cosine to hpcadapt.train)", readers[0])
