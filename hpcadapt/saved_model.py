"""The trained model the entry point keeps (``--save-model PATH``): the weights and what
rebuilds the model around them (name, input shape, classes, widths, the vocabulary of a
character model), written atomically and read back without pickle (``weights_only``)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from hpcadapt.base.errors import ConfigurationError
from hpcadapt.models import build_model

__all__ = ["SavedModel", "save_model", "load_model"]

FORMAT = "hpcadapt-model-1"


@dataclass
class SavedModel:
    """A built-in model's arguments and weights, as ``--save-model`` writes them."""

    model: str
    input_shape: Tuple[int, ...]
    num_classes: int
    dataset: str
    hidden: List[int] = field(default_factory=list)
    width: int = 32
    vocab: Optional[str] = None
    state_dict: Dict[str, torch.Tensor] = field(default_factory=dict)

    def build(self) -> nn.Module:
        """The model with these weights, in eval mode, on the CPU."""
        model = build_model(self.model, self.input_shape, self.num_classes,
                            hidden=list(self.hidden), width=self.width)
        model.load_state_dict(self.state_dict)
        return model.eval()


def save_model(path: str, saved: SavedModel) -> None:
    """Write ``saved`` to ``path`` atomically: a private temporary file in the same folder,
    renamed over ``path`` (a reader never sees half a file; a symlink at ``path`` is
    replaced, never followed)."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".hpcadapt-model-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": FORMAT, "model": saved.model,
                        "input_shape": list(saved.input_shape),
                        "num_classes": saved.num_classes, "dataset": saved.dataset,
                        "hidden": list(saved.hidden), "width": saved.width,
                        "vocab": saved.vocab,
                        "state_dict": {k: v.detach().cpu()
                                       for k, v in saved.state_dict.items()}}, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load_model(path: str) -> SavedModel:
    """Read what ``save_model`` wrote; ConfigurationError in one line for anything else."""
    try:
        data: Any = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigurationError(f"{path}: no such file (write one with hpcadapt-train "
                                 f"--save-model {path})") from None
    except Exception as exc:  # torch raises several types for files it cannot read
        raise ConfigurationError(f"{path}: not a model saved by --save-model ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigurationError(f"{path}: not a model saved by --save-model (format "
                                 f"{data.get('format') if isinstance(data, dict) else None!r})")
    return SavedModel(model=data["model"], input_shape=tuple(data["input_shape"]),
                      num_classes=int(data["num_classes"]), dataset=data["dataset"],
                      hidden=list(data["hidden"]), width=int(data["width"]),
                      vocab=data["vocab"], state_dict=data["state_dict"])
