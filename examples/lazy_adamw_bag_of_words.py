"""LazyAdamW on a bag-of-words classifier: an ``nn.EmbeddingBag`` over a 50,000-word vocabulary
(documents of different lengths, given as offsets) where each step moves only the rows its
documents used, and a linear head that gets plain AdamW.

    python examples/lazy_adamw_bag_of_words.py [--steps 300]
"""

from __future__ import annotations

import argparse

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


def main(argv: list[str] | None = None) -> float:
    """Train, print the test accuracy every 100 steps and at the end, and return it."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    steps = parser.parse_args(argv).steps
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = nn.ModuleDict({"bag": nn.EmbeddingBag(VOCABULARY, 32, mode="mean"), "head": nn.Linear(32, TOPICS)})

    def classify(words: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return model["head"](model["bag"](words, offsets))

    optimizer = LazyAdamW(model, lr=1e-2)
    test = documents(500, torch.Generator().manual_seed(1))

    def accuracy() -> float:
        with torch.no_grad():
            return float((classify(test[0], test[1]).argmax(1) == test[2]).float().mean())

    for step in range(1, steps + 1):
        words, offsets, topics = documents(32, generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(classify(words, offsets), topics).backward()
        optimizer.step()  # at most ~1,300 of the 50,000 rows move
        if step % 100 == 0:
            print(f"step {step}: test accuracy {accuracy():.3f}")
    final = accuracy()
    print(f"LazyAdamW, {steps} steps: test accuracy {final:.3f}")
    return final


if __name__ == "__main__":
    main()
