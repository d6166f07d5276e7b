"""NLMS identifying an unknown 16-tap filter online, one sample at a time, while the input's scale
drifts over six orders of magnitude, beside plain LMS (SGD with the same fixed step, which the
drift makes diverge; a step small enough for the largest inputs would crawl on the smallest).

    python examples/nlms_system_identification.py [--steps 2000]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch
from torch import nn

from inputaware_optim import NLMS


def train(make_optimizer: Callable[[nn.Module], torch.optim.Optimizer], steps: int) -> tuple[float, float]:
    """Run a zero-initialized filter over the same stream; return (relative error, seconds), the
    error ``inf`` if the filter diverged (its weights overflowed)."""
    generator = torch.Generator().manual_seed(0)
    unknown = torch.randn(1, 16, generator=generator)  # the system to identify
    estimate = nn.Linear(16, 1, bias=False)
    nn.init.zeros_(estimate.weight)
    optimizer = make_optimizer(estimate)
    error = 1.0
    start = time.perf_counter()
    for step in range(1, steps + 1):
        scale = 10.0 ** (-3 + 6 * (step % 400) / 400)  # from 1e-3 to 1e3, again and again
        x = torch.randn(1, 16, generator=generator) * scale
        target = x @ unknown.T + 1e-4 * scale * torch.randn(1, 1, generator=generator)
        optimizer.zero_grad()
        (0.5 * (estimate(x) - target).pow(2)).sum().backward()
        optimizer.step()
        error = float((estimate.weight.detach() - unknown).norm() / unknown.norm())
        if not math.isfinite(error):
            return math.inf, time.perf_counter() - start
    return error, time.perf_counter() - start


def main(argv: list[str] | None = None) -> float:
    """Run LMS and NLMS, print both final relative errors and times, and return NLMS's."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2000)
    steps = parser.parse_args(argv).steps
    # One torch thread, as the benchmarks time: the two times printed below then compare between runs
    # (with torch's default threads, on a machine doing other work, they swung by 5x).
    torch.set_num_threads(1)
    results = {
        "SGD (LMS, lr 0.5)": train(lambda model: torch.optim.SGD(model.parameters(), lr=0.5), steps),
        "NLMS (lr 0.5)": train(lambda model: NLMS(model, lr=0.5), steps),
    }
    for name, (error, seconds) in results.items():
        outcome = f"relative error {error:.2e}" if math.isfinite(error) else "diverged"
        print(f"{name:>17}: {outcome}, {seconds:.1f} s")
    return results["NLMS (lr 0.5)"][0]


if __name__ == "__main__":
    main()
