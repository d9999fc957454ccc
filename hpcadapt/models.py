"""Built-in models: an MLP, a small CNN, a ResNet-style network (GroupNorm, so no
per-rank running statistics drift apart between replicas) and a small character-level
causal transformer (``charlm``)."""

from __future__ import annotations

import math
from typing import Callable, Dict, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from hpcadapt.base.errors import ConfigurationError

__all__ = ["MODELS", "build_model", "count_parameters"]


def mlp(input_shape: Tuple[int, ...], num_classes: int, *, hidden: Sequence[int] = (256, 256),
        **_) -> nn.Module:
    layers: list = [nn.Flatten()]
    width = int(np.prod(input_shape))
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def cnn(input_shape: Tuple[int, ...], num_classes: int, *, width: int = 32,
        batch_norm: bool = False, **_) -> nn.Module:
    """A small CNN: 2-D for images (C, H, W), 1-D for sequences (C, L) such as MNIST-1D.
    ``batch_norm``: a BatchNorm after each 2-D convolution (running statistics: buffers
    that the replicas must keep consistent; the buffer tests and benchmark use it)."""
    if len(input_shape) == 2:
        return _cnn1d(input_shape, num_classes, width)
    c = input_shape[0]

    def conv(cin: int, cout: int) -> list:
        if not batch_norm:
            return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *conv(c, width), *conv(width, width * 2), nn.MaxPool2d(2), *conv(width * 2, width * 2),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        nn.Linear(width * 2 * 4, 128), nn.ReLU(), nn.Linear(128, num_classes),
    )


def _cnn1d(input_shape: Tuple[int, ...], num_classes: int, width: int) -> nn.Module:
    """Greydanus' MNIST-1D baseline shape: three strided convolutions keep where a feature
    is (pooling it away costs accuracy on translated signals), then one linear layer."""
    c, length = input_shape
    features = nn.Sequential(
        nn.Conv1d(c, width, 5, stride=2, padding=2), nn.ReLU(),
        nn.Conv1d(width, width, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv1d(width, width, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten())
    with torch.no_grad():
        flat = features(torch.zeros(1, c, length)).shape[1]
    return nn.Sequential(features, nn.Linear(flat, num_classes))


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(min(8, cout), cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(min(8, cout), cout)
        self.skip = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                      nn.GroupNorm(min(8, cout), cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.skip(x))


def resnet(input_shape: Tuple[int, ...], num_classes: int, *, width: int = 32,
           blocks: Sequence[int] = (1, 1, 1), **_) -> nn.Module:
    """A ResNet-style network: a stem, then stages of basic blocks doubling the width."""
    layers: list = [nn.Conv2d(input_shape[0], width, 3, padding=1, bias=False),
                    nn.GroupNorm(min(8, width), width), nn.ReLU()]
    cin = width
    for i, n in enumerate(blocks):
        cout = width * (2 ** i)
        for j in range(n):
            layers.append(_Block(cin, cout, 2 if (j == 0 and i > 0) else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


class _CausalBlock(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)                                 # each [B, heads, T, d/heads]
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.mlp(self.norm2(h))


class CharLM(nn.Module):
    """A small causal transformer over characters: token and learned position embeddings,
    ``layers`` pre-LayerNorm blocks of ``heads``-head causal self-attention and a 4x GELU
    MLP, a final LayerNorm and a linear head (untied). GPT-2's initialisation (normal, std
    0.02; the residual projections scaled by 1/sqrt(2 * layers)).

    Input: ids ``[B, T]`` (int64, ``T <= context``). Output: logits ``[B, vocab, T]``, the
    class axis second as ``nn.CrossEntropyLoss`` expects, so ``CrossEntropyLoss()(model(x),
    y)`` with targets ``y`` of shape ``[B, T]`` is the mean per-character cross-entropy and
    ``model(x).argmax(1)`` the predicted next characters ``[B, T]``. Position t sees only
    positions <= t."""

    def __init__(self, vocab: int, context: int, *, d_model: int = 64, heads: int = 4,
                 layers: int = 2):
        super().__init__()
        if d_model % heads:
            raise ConfigurationError(f"charlm: d_model {d_model} is not a multiple of the "
                                     f"{heads} heads")
        self.context = context
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(_CausalBlock(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") \
                    or name.endswith("mlp.2.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.context:
            raise ValueError(f"charlm: {t} characters in, at most {self.context} (context)")
        h = self.tok(ids) + self.pos.weight[:t]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h)).transpose(1, 2)


def charlm(input_shape: Tuple[int, ...], num_classes: int, *, d_model: int = 64,
           heads: int = 4, layers: int = 2, **_) -> nn.Module:
    """``CharLM`` for ``input_shape == (context,)`` and a vocabulary of ``num_classes``
    characters (the shakespeare dataset's): about 0.11M parameters by default."""
    if len(input_shape) != 1:
        raise ConfigurationError(f"charlm takes sequences of character ids (input shape "
                                 f"(context,)), not {tuple(input_shape)}: use it with "
                                 f"--dataset shakespeare")
    return CharLM(num_classes, int(input_shape[0]), d_model=d_model, heads=heads,
                  layers=layers)


MODELS: Dict[str, Callable[..., nn.Module]] = {"mlp": mlp, "cnn": cnn, "resnet": resnet,
                                               "charlm": charlm}


def build_model(name: str, input_shape: Tuple[int, ...], num_classes: int, *, seed: int = 0,
                **options) -> nn.Module:
    """Build a built-in model with seeded initial weights (rank 0's are broadcast anyway)."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown model {name!r}; choose one of {sorted(MODELS)}") from None
    torch.manual_seed(seed)
    return factory(tuple(input_shape), num_classes, **options)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
