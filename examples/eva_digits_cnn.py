"""Eva on the digits: the ConvNeXt-style CNN of the K-FAC example, preconditioned by rank-one
Kronecker vectors (two vectors per layer, one pair per group of the depthwise convolution)
instead of K-FAC's matrices, with the KL clip.

    python examples/eva_digits_cnn.py [--steps 150]
"""

from __future__ import annotations

import argparse

import torch
from _digits import accuracy, digits
from torch import nn

from inputaware_optim import Eva


def main(argv: list[str] | None = None) -> float:
    """Train, print the test accuracy every 50 steps and at the end, and return it."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=150)
    steps = parser.parse_args(argv).steps
    torch.manual_seed(0)
    x, y, x_test, y_test = digits(images=True)
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
    optimizer = Eva(model, lr=0.1, momentum=0.9)
    print(optimizer.coverage())
    for step in range(1, steps + 1):
        batch = torch.randint(0, len(x), (64,))
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        optimizer.step()
        if step % 50 == 0:
            print(f"step {step}: test accuracy {accuracy(model, x_test, y_test):.3f}")
    final = accuracy(model, x_test, y_test)
    print(f"Eva, {steps} steps: test accuracy {final:.3f}")
    return final


if __name__ == "__main__":
    main()
