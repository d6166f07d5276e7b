"""DP-SGD on the digits with Poisson sampling (Opacus's data loader) and the privacy spent, from
Opacus's accountant: per-sample clipping and Gaussian noise on a small MLP, beside non-private SGD
with the same learning rate and momentum (the same start, the same batches): the accuracy privacy
costs.

    python examples/dp_sgd_digits.py [--epochs 10]

Needs ``opacus`` (``pip install opacus``) for the sampling and the accounting.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from _digits import accuracy, digits
from opacus.data_loader import DPDataLoader
from torch import nn
from torch.utils.data import TensorDataset

from inputaware_optim import DPSGD

SAMPLE_RATE = 64 / 1500  # each step draws each training digit with this probability: 64 expected


def train(make_optimizer: Callable[[nn.Module], torch.optim.Optimizer], epochs: int) -> tuple[float, float]:
    """Train a fresh MLP (seed 0) on the same Poisson-sampled batches; return (test accuracy, seconds)."""
    x, y, x_test, y_test = digits()
    loader = DPDataLoader(TensorDataset(x, y), sample_rate=SAMPLE_RATE, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    optimizer = make_optimizer(model)
    start = time.perf_counter()
    for _ in range(epochs):
        for inputs, labels in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
    return accuracy(model, x_test, y_test), time.perf_counter() - start


def main(argv: list[str] | None = None) -> float:
    """Train with SGD and with DP-SGD, print both test accuracies and times and the ε spent, and
    return DP-SGD's accuracy."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    epochs = parser.parse_args(argv).epochs
    # One torch thread, as the benchmarks time: the two times printed below then compare between runs
    # (with torch's default threads, on a machine doing other work, they swung by 5x).
    torch.set_num_threads(1)
    private: list[DPSGD] = []  # the DP-SGD run's optimizer, kept for its ε

    def dp_sgd(model: nn.Module) -> DPSGD:
        private.append(
            DPSGD(
                model,
                lr=0.5,
                max_grad_norm=1.0,
                noise_multiplier=1.0,
                expected_batch_size=64,  # the noised sum is divided by the expected batch, not the drawn one
                sample_rate=SAMPLE_RATE,
                momentum=0.9,
            )
        )
        return private[0]

    results = {
        "SGD (not private)": train(lambda model: torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), epochs),
        "DP-SGD": train(dp_sgd, epochs),
    }
    for name, (final, seconds) in results.items():
        print(f"{name:>17}: test accuracy {final:.3f}, {seconds:.1f} s")
    print(f"DP-SGD, {epochs} epochs: epsilon {private[0].epsilon(delta=1e-5):.2f} at delta 1e-5")
    return results["DP-SGD"][0]


if __name__ == "__main__":
    main()
