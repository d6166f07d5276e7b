"""Eva on the digits: the ConvNeXt-style CNN of the K-FAC example, preconditioned by rank-one
Kronecker vectors (two vectors per layer, one pair per group of the depthwise convolution)
instead of K-FAC's matrices, with the KL clip, beside plain SGD with the same learning rate and
momentum (the same start, the same batches).

    python examples/eva_digits_cnn.py [--steps 150]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from _digits import accuracy, digits
from torch import nn

from inputaware_optim import Eva


def train(make_optimizer: Callable[[nn.Module], torch.optim.Optimizer], steps: int) -> tuple[float, float]:
    """Train a fresh CNN (seed 0) on the same batches; return (test accuracy, seconds)."""
    x, y, x_test, y_test = digits(images=True)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.Conv2d(16, 16, 3, padding=1, groups=16),  # depthwise
        nn.GroupNorm(1, 16),
        nn.Conv2d(16, 32, 1),
        nn.GELU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(128, 10),
    )
    optimizer = make_optimizer(model)
    batches = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for _ in range(steps):
        batch = torch.randint(0, len(x), (64,), generator=batches)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        optimizer.step()
    return accuracy(model, x_test, y_test), time.perf_counter() - start


def eva(model: nn.Module) -> Eva:
    optimizer = Eva(model, lr=0.1, momentum=0.9)
    print(optimizer.coverage())  # which parameters Eva preconditions
    return optimizer


def main(argv: list[str] | None = None) -> float:
    """Train with SGD and with Eva, print both test accuracies and times, and return Eva's."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=150)
    steps = parser.parse_args(argv).steps
    # One torch thread, as the benchmarks time: the two times printed below then compare between runs
    # (with torch's default threads, on a machine doing other work, they swung by 5x).
    torch.set_num_threads(1)
    results = {
        "SGD (momentum 0.9)": train(lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), steps),
        "Eva": train(eva, steps),
    }
    for name, (final, seconds) in results.items():
        print(f"{name:>18}: test accuracy {final:.3f}, {seconds:.1f} s")
    return results["Eva"][0]


if __name__ == "__main__":
    main()
