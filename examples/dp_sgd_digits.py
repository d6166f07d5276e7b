"""DP-SGD on the digits with Poisson sampling (Opacus's data loader) and the privacy spent, from
Opacus's accountant: per-sample clipping and Gaussian noise on a small MLP.

    python examples/dp_sgd_digits.py [--epochs 10]

Needs ``opacus`` (``pip install opacus``) for the sampling and the accounting.
"""

from __future__ import annotations

import argparse

import torch
from _digits import accuracy, digits
from opacus.data_loader import DPDataLoader
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from inputaware_optim import DPSGD


def main(argv: list[str] | None = None) -> float:
    """Train, print the test accuracy and ε after each epoch, and return the final accuracy."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    epochs = parser.parse_args(argv).epochs
    torch.manual_seed(0)
    x, y, x_test, y_test = digits()
    loader = DPDataLoader.from_data_loader(DataLoader(TensorDataset(x, y), batch_size=64))
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    optimizer = DPSGD(
        model,
        lr=0.5,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=64,  # the noised sum is divided by the expected batch, not the drawn one
        sample_rate=1 / len(loader),
        momentum=0.9,
    )
    for epoch in range(1, epochs + 1):
        for inputs, labels in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
        print(
            f"epoch {epoch}: test accuracy {accuracy(model, x_test, y_test):.3f}, "
            f"epsilon {optimizer.epsilon(delta=1e-5):.2f} at delta 1e-5"
        )
    final = accuracy(model, x_test, y_test)
    print(f"DP-SGD, {epochs} epochs: test accuracy {final:.3f}, epsilon {optimizer.epsilon(delta=1e-5):.2f}")
    return final


if __name__ == "__main__":
    main()
