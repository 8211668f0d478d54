"""Token sets for the gpt model: Python's own source as a character corpus (on every
machine, no download), or synthetic token sequences.

Both end as (inputs, next-token targets) pairs of `context` tokens, so the loop treats
them like image batches: `batch(indices) -> (x, y)`.
"""

from __future__ import annotations

import os
import string

import torch

from workers.dataset_check import source_root

# A fixed alphabet, not the corpus's own: the model's shape (and so a checkpoint) must not
# depend on which files a machine happens to have. Anything else reads as UNKNOWN.
ALPHABET = string.printable
UNKNOWN = len(ALPHABET)
VOCAB_SIZE = len(ALPHABET) + 1
_CODES = {c: i for i, c in enumerate(ALPHABET)}


def python_source(root: str | None, max_chars: int) -> str:
    """The first `max_chars` characters of the .py files under `root` (default: the
    standard library), in sorted path order so every worker reads the same text."""
    root = root or source_root()
    if not os.path.isdir(root):
        raise FileNotFoundError(f"dataset 'python_source': {root} is not a directory of .py files")
    parts, total = [], 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                text = f.read(max_chars - total)
            parts.append(text)
            total += len(text)
            if total >= max_chars:
                return "".join(parts)
    if total == 0:
        raise FileNotFoundError(f"dataset 'python_source': no .py files under {root}")
    return "".join(parts)


def encode(text: str) -> torch.Tensor:
    return torch.tensor([_CODES.get(c, UNKNOWN) for c in text], dtype=torch.long)


def decode(tokens) -> str:
    return "".join(ALPHABET[t] if t < len(ALPHABET) else "\ufffd" for t in tokens)


def windows(stream: torch.Tensor, context: int) -> torch.Tensor:
    """Non-overlapping samples of context + 1 tokens (inputs and the shifted targets)."""
    n = (len(stream) - 1) // context
    return stream[: n * context + 1].unfold(0, context + 1, context)


def synthetic_tokens(*, size: int, vocab_size: int, context: int, seed: int, noise: float = 0.05) -> torch.Tensor:
    """`size` sequences counting up from a random start by a random stride (mod the
    vocabulary), a share `noise` of tokens replaced at random: learnable from two
    tokens of context, never perfectly."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (size, 1), generator=g)
    stride = torch.randint(1, min(8, vocab_size), (size, 1), generator=g)
    seq = (start + stride * torch.arange(context + 1)) % vocab_size
    flip = torch.rand(seq.shape, generator=g) < noise
    return torch.where(flip, torch.randint(0, vocab_size, seq.shape, generator=g), seq)
