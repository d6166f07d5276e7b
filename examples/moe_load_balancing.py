"""Aux-loss-free MoE load balancing (DeepSeek-V3) beside plain AdamW, on a mixture of 8 experts
(top-2) whose router starts skewed, trained under activation checkpointing.

The loads are counted from the router calls whose gradient the step applies, so the
checkpointed forward's re-run is not counted twice (torchtitan halves its count by hand there).

    python examples/moe_load_balancing.py [--steps 200]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from inputaware_optim import InputAwareAdamW, LoadBalancing

EXPERTS, TOP_K, DIM = 8, 2, 16


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        with torch.no_grad():
            self.gate.weight[:2] += 0.5  # two experts favoured from the start
        self.register_buffer("expert_bias", torch.zeros(EXPERTS))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.gate(x).sigmoid()
        indices = (scores + self.expert_bias).topk(TOP_K, dim=-1).indices  # the bias steers the choice only
        weights = scores.gather(-1, indices)
        return weights / weights.sum(-1, keepdim=True), indices


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 32), nn.GELU(), nn.Linear(32, DIM)) for _ in range(EXPERTS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = self.router(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = (indices == e).nonzero(as_tuple=True)
            if token.numel():
                out = out.index_add(0, token, weights[token, slot, None] * expert(x[token]))
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(DIM, DIM)
        self.moe = MoE()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        return self.head(checkpoint(self.moe, h, use_reentrant=False))


@torch.no_grad()
def imbalance(model: Net, x: torch.Tensor) -> float:
    """The busiest expert's tokens over the mean (1.0 is perfectly balanced)."""
    _, indices = model.moe.router(torch.tanh(model.embed(x)))
    load = torch.bincount(indices.reshape(-1), minlength=EXPERTS).double()
    return float(load.max() / load.mean())


def train(steps: int, balanced: bool) -> tuple[float, float, float]:
    """Train on a fixed random regression task; return (final loss, final imbalance, seconds)."""
    model = Net()
    optimizer = InputAwareAdamW(model, lr=3e-3)
    if balanced:
        LoadBalancing([model.moe.router], update_rate=1e-3).attach(optimizer)
    generator = torch.Generator().manual_seed(1)
    teacher = torch.randn(DIM, 1, generator=generator)
    held_out = torch.randn(512, DIM, generator=generator)
    start = time.perf_counter()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        x = torch.randn(128, DIM, generator=generator)
        optimizer.zero_grad()
        loss = (model(x) - torch.sin(x @ teacher)).pow(2).mean()
        loss.backward()
        optimizer.step()
    return loss.item(), imbalance(model, held_out), time.perf_counter() - start


def main(argv: list[str] | None = None) -> float:
    """Train with and without balancing; print both; return the balanced run's final imbalance."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    steps = parser.parse_args(argv).steps
    # One torch thread, as the benchmarks time: the two times printed below then compare between runs
    # (with torch's default threads, on a machine doing other work, they swung by 5x).
    torch.set_num_threads(1)
    for name, balanced in (("AdamW", False), ("AdamW + LoadBalancing", True)):
        loss, ratio, seconds = train(steps, balanced)
        print(f"{name:>22}: loss {loss:.4f}, busiest expert {ratio:.2f}x the mean load, {seconds:.1f} s")
    return ratio


if __name__ == "__main__":
    main()
