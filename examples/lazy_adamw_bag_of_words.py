"""LazyAdamW on a bag-of-words classifier: an ``nn.EmbeddingBag`` over a 50,000-word vocabulary
(documents of different lengths, given as offsets) where each step moves only the rows its
documents used, and a linear head that gets plain AdamW; beside dense AdamW (torch's fused
kernel, every row every step) from the same start on the same documents.

    python examples/lazy_adamw_bag_of_words.py [--steps 300]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn

from inputaware_optim import LazyAdamW

VOCABULARY, TOPICS = 50_000, 4


def documents(count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(words, offsets, topics)``: each document 5-40 words, a third of them from its topic's
    1,000 words, the rest from the whole vocabulary."""
    topics = torch.randint(0, TOPICS, (count,), generator=generator)
    lengths = torch.randint(5, 41, (count,), generator=generator)
    words = []
    for topic, length in zip(topics.tolist(), lengths.tolist(), strict=True):
        common = torch.randint(0, VOCABULARY, (length,), generator=generator)
        own = topic * 1000 + torch.randint(0, 1000, (length,), generator=generator)
        words.append(torch.where(torch.rand(length, generator=generator) < 1 / 3, own, common))
    offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), lengths[:-1]]), 0)
    return torch.cat(words), offsets, topics


def train(make_optimizer: Callable[[nn.Module], torch.optim.Optimizer], steps: int) -> tuple[float, float]:
    """Train a fresh classifier (seed 0) on the same documents; return (test accuracy, seconds)."""
    generator = torch.Generator().manual_seed(0)
    batches = [documents(32, generator) for _ in range(steps)]  # drawn before the clock starts
    words, offsets, topics = documents(500, torch.Generator().manual_seed(1))  # the test set
    torch.manual_seed(0)
    model = nn.ModuleDict({"bag": nn.EmbeddingBag(VOCABULARY, 32, mode="mean"), "head": nn.Linear(32, TOPICS)})
    optimizer = make_optimizer(model)
    start = time.perf_counter()
    for batch_words, batch_offsets, batch_topics in batches:
        optimizer.zero_grad()
        logits = model["head"](model["bag"](batch_words, batch_offsets))
        nn.functional.cross_entropy(logits, batch_topics).backward()
        optimizer.step()  # LazyAdamW moves at most ~1,300 of the 50,000 rows, AdamW all of them
    seconds = time.perf_counter() - start
    with torch.no_grad():
        predicted = model["head"](model["bag"](words, offsets)).argmax(1)
    return float((predicted == topics).float().mean()), seconds


def main(argv: list[str] | None = None) -> float:
    """Train with AdamW and with LazyAdamW, print both test accuracies and times, and return LazyAdamW's."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    steps = parser.parse_args(argv).steps
    # One torch thread, as the benchmarks time: the two times printed below then compare between runs
    # (with torch's default threads, on a machine doing other work, they swung by 5x).
    torch.set_num_threads(1)
    results = {
        "AdamW (dense, fused)": train(lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), steps),
        "LazyAdamW": train(lambda model: LazyAdamW(model, lr=1e-2), steps),
    }
    for name, (final, seconds) in results.items():
        print(f"{name:>20}: test accuracy {final:.3f}, {seconds:.1f} s")
    return results["LazyAdamW"][0]


if __name__ == "__main__":
    main()
