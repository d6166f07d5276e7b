"""The realistic workload: a byte-level GPT trained on the Python standard library's own sources.

The text ships with every Python (the ``*.py`` files at the top of the standard library, about
4.7 MB), so the workload needs no download. Files are split, not bytes: every tenth file by name
is validation, the rest training, so validation text is code the model never saw.

``SIZES`` gives the model at each run size; ``"default"`` is the 10.9M-parameter model of the
realistic-size tables (6 blocks, width 384, context 128, batch 8: arithmetic dominates a step on
a CPU, unlike the small models' microsecond calls).
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .core import Config
from .models import GPT

__all__ = ["SIZES", "GPTSize", "batches", "build", "corpus", "evaluate", "loss", "size_of"]

VOCABULARY = 256  # bytes
VALIDATION_EVERY = 10  # every tenth file (sorted by name) is validation


@dataclass(frozen=True)
class GPTSize:
    """One model and batch size of the workload."""

    layers: int
    width: int
    context: int
    batch: int

    @property
    def heads(self) -> int:
        return max(1, self.width // 64)

    def describe(self, model: nn.Module | None = None) -> str:
        count = sum(p.numel() for p in (model or build(self)).parameters())
        return (
            f"byte-level GPT, {count / 1e6:.1f}M parameters ({self.layers} blocks, width {self.width}, "
            f"{self.heads} heads, context {self.context}), batch {self.batch} × {self.context} tokens"
        )


SIZES = {
    "quick": GPTSize(layers=2, width=64, context=32, batch=2),
    "small": GPTSize(layers=4, width=192, context=128, batch=8),  # time to result at size default
    "default": GPTSize(layers=6, width=384, context=128, batch=8),
}


def size_of(config: Config) -> GPTSize:
    """The realistic-size model of a run (the tiny one at size quick)."""
    return SIZES[config.pick("quick", "default")]


@cache
def corpus() -> tuple[Tensor, Tensor]:
    """The training and validation bytes (``uint8``), split by file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise RuntimeError(f"no Python sources under {root}: the GPT workload trains on the standard library's *.py")
    train, validation = bytearray(), bytearray()
    for index, path in enumerate(files):
        (validation if index % VALIDATION_EVERY == 0 else train).extend(path.read_bytes())
    return torch.frombuffer(train, dtype=torch.uint8).clone(), torch.frombuffer(validation, dtype=torch.uint8).clone()


def build(size: GPTSize) -> nn.Module:
    """A fresh model (seed the generator first for identical copies)."""
    return GPT(VOCABULARY, size.context, size.width, size.layers, size.heads)


def batches(size: GPTSize, seed: int, split: str = "train") -> Iterator[tuple[Tensor, Tensor]]:
    """Endless random windows of the split: ``(tokens, next tokens)``, each ``batch × context`` int64."""
    data = corpus()[0 if split == "train" else 1]
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(size.context + 1)
    while True:
        starts = torch.randint(0, len(data) - size.context - 1, (size.batch, 1), generator=generator)
        window = data[starts + offsets].long()
        yield window[:, :-1], window[:, 1:]


def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Mean next-byte cross-entropy (nats)."""
    logits = model(batch[0])
    return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


@torch.no_grad()
def evaluate(model: nn.Module, size: GPTSize, windows: int = 32, seed: int = 1234) -> float:
    """Mean validation loss (nats per byte) over ``windows`` fixed batches of held-out files."""
    was_training = model.training
    model.eval()
    stream = batches(size, seed, "validation")
    total = sum(loss(model, next(stream)).item() for _ in range(windows)) / windows
    model.train(was_training)
    return total
