"""``python -m hpcadapt.generate MODEL.pt --prompt "ROMEO:" --chars 300``: text from a
character model that ``hpcadapt-train --model charlm --dataset shakespeare --save-model
MODEL.pt`` kept, one character at a time (the last ``context`` characters in, the next one
drawn from the softmax at ``--temperature``; 0 takes the likeliest)."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import torch

from hpcadapt.base.errors import ConfigurationError
from hpcadapt.saved_model import load_model

__all__ = ["generate", "main"]


def generate(path: str, prompt: str, chars: int, *, temperature: float = 0.8,
             seed: int = 0) -> str:
    """``chars`` characters after ``prompt`` (returned without it)."""
    saved = load_model(path)
    if saved.model != "charlm" or not saved.vocab:
        raise ConfigurationError(f"{path} holds a {saved.model} model of {saved.dataset}: text "
                                 f"comes from --model charlm --dataset shakespeare")
    model, vocab = saved.build(), saved.vocab
    index = {c: i for i, c in enumerate(vocab)}
    unknown = sorted({c for c in prompt if c not in index})
    if unknown:
        raise ConfigurationError(f"--prompt has characters the model never saw: "
                                 f"{''.join(unknown)!r}")
    ids = [index[c] for c in prompt] or [index.get("\n", 0)]
    context = int(saved.input_shape[0])
    generator = torch.Generator().manual_seed(seed)
    out: List[str] = []
    with torch.no_grad():
        for _ in range(chars):
            logits = model(torch.tensor([ids[-context:]]))[0, :, -1]
            if temperature <= 0:
                nxt = int(logits.argmax())
            else:
                probs = torch.softmax(logits / temperature, dim=0)
                nxt = int(torch.multinomial(probs, 1, generator=generator))
            ids.append(nxt)
            out.append(vocab[nxt])
    return "".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcadapt.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a file written by hpcadapt-train --save-model")
    p.add_argument("--prompt", default="", help="the text to continue (default: none)")
    p.add_argument("--chars", type=int, default=300, help="characters to write")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature (0: always the likeliest character)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.chars < 1:
        p.error(f"--chars {args.chars}: give 1 or more")
    try:
        text = generate(args.model, args.prompt, args.chars, temperature=args.temperature,
                        seed=args.seed)
    except ConfigurationError as exc:
        p.error(str(exc))
    print(args.prompt + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
