"""What ``Job`` checks and chooses as it starts: the device of this rank, the data plane for
the model's gradients, the output paths, and rank 0's verdict told to every rank so that all
stop together.

A part of ``hpcadapt.job.Job`` (a mixin): its methods work on the job's state, which
``Job.__init__`` and ``Job.setup`` create; this module holds one concern of it."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from hpcadapt.base.errors import ConfigurationError, on_every_rank
from hpcadapt.base.paths import unwritable
from hpcadapt.comm.tell import root_tells

__all__ = ["SetUpChecks"]

log = logging.getLogger("hpcadapt.job")


class SetUpChecks:
    """What ``Job`` checks and chooses as it starts: the device of this rank, the data
    plane for the model's gradients, the output paths, and rank 0's verdict told to
    every rank so that all stop together."""

    def _choose_device(self):
        """--device: this rank's device from its local rank (one GPU per rank; ranks share
        GPUs, over the host-staged plane, when a node has more ranks than GPUs)."""
        from hpcadapt.cuda.device import choose_device

        choice, error = None, ""
        try:
            choice = choose_device(self.options.device, local_rank=self.world.local_rank,
                                   local_size=self.world.local_size)
        except ConfigurationError as exc:
            error = str(exc)
        self._agree(error)  # rank 0's problem: raised on every rank together, printed once
        if choice is None:
            raise ConfigurationError(error)  # this rank's alone: the job ends (exception hook)
        if choice.kind == "cuda":
            torch.cuda.set_device(choice.index)
        if self.world.rank == 0 and choice.kind == "cuda":
            log.info("device: %s", choice.reason)
        return choice

    def _data_plane(self, model: nn.Module) -> str:
        """The plane for ``model``'s gradients; ConfigurationError when the model is not
        on the device the job trains on (``--device`` asked explicitly)."""
        o = self.options
        params = [p for p in model.parameters()]
        where = params[0].device if params else torch.device("cpu")
        if o.device != "auto" and where.type != self.device.type:
            raise ConfigurationError(
                f"the model is on {where} but --device {o.device} trains on {self.device}: "
                f"call model.to(job.device) before job.setup")
        if o.data_plane == "auto" and where.type == "cuda":
            return self.device_choice.data_plane if self.device_choice.kind == "cuda" \
                else "auto"
        return o.data_plane

    def _agree(self, error: str) -> None:
        """Rank 0's verdict for everyone: ConfigurationError on every rank if it is one."""
        error = root_tells(error or None, self.world, what="rank 0's verdict")
        if error:
            raise on_every_rank(ConfigurationError(error))

    def _check_output_folders(self) -> None:
        """Refuse at start (not at the first write, nor when the stop signal comes) an output
        path that cannot be written, itself or its folder: rank 0 probes, every rank hears
        its verdict."""
        o = self.options
        error = ""
        if self.world.rank == 0:
            for flag, path in (("--checkpoint", o.checkpoint), ("--metrics-file", o.metrics_file),
                               ("--summary-json", o.summary_json)):
                if path and not error:
                    error = unwritable(flag, path, replaced=flag == "--checkpoint")
            if o.sample_log and not error:
                error = unwritable("--sample-log", o.sample_log, folder_path=True)
        self._agree(error)

    def _say_once(self, message: str, *args: Any) -> None:
        if self.world.rank == 0:
            log.warning(message, *args)
