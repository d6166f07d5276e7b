"""FOOF on the digits: an MLP trained with inputs-preconditioned SGD.

python examples/foof_digits.py [--steps 300]
"""

from __future__ import annotations

import argparse

import torch
from _digits import accuracy, digits
from torch import nn

from inputaware_optim import FOOF


def main(argv: list[str] | None = None) -> float:
    """Train, print the test accuracy every 100 steps and at the end, and return it."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    steps = parser.parse_args(argv).steps
    torch.manual_seed(0)
    x, y, x_test, y_test = digits()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = FOOF(model, lr=0.05, momentum=0.9, damping=0.1, update_every=10)
    print(optimizer.coverage())
    for step in range(1, steps + 1):
        batch = torch.randint(0, len(x), (64,))
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        optimizer.step()
        if step % 100 == 0:
            print(f"step {step}: test accuracy {accuracy(model, x_test, y_test):.3f}")
    final = accuracy(model, x_test, y_test)
    print(f"FOOF, {steps} steps: test accuracy {final:.3f}")
    return final


if __name__ == "__main__":
    main()
