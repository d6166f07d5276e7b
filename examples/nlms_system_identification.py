"""NLMS identifying an unknown 16-tap filter online, one sample at a time, while the input's scale
drifts over six orders of magnitude (where a fixed SGD step either diverges or crawls).

    python examples/nlms_system_identification.py [--steps 2000]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from inputaware_optim import NLMS


def main(argv: list[str] | None = None) -> float:
    """Run the filter online, print its relative error every 500 samples, and return the last one."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2000)
    steps = parser.parse_args(argv).steps
    generator = torch.Generator().manual_seed(0)
    unknown = torch.randn(1, 16, generator=generator)  # the system to identify
    estimate = nn.Linear(16, 1, bias=False)
    nn.init.zeros_(estimate.weight)
    optimizer = NLMS(estimate, lr=0.5)
    error = 1.0
    for step in range(1, steps + 1):
        scale = 10.0 ** (-3 + 6 * (step % 400) / 400)  # from 1e-3 to 1e3, again and again
        x = torch.randn(1, 16, generator=generator) * scale
        target = x @ unknown.T + 1e-4 * scale * torch.randn(1, 1, generator=generator)
        optimizer.zero_grad()
        (0.5 * (estimate(x) - target).pow(2)).sum().backward()
        optimizer.step()
        error = float((estimate.weight.detach() - unknown).norm() / unknown.norm())
        if step % 500 == 0:
            print(f"sample {step}: relative error {error:.2e}")
    print(f"NLMS, {steps} samples: relative error {error:.2e}")
    return error


if __name__ == "__main__":
    main()
