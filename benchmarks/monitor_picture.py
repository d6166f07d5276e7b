"""The README's monitoring picture: a digits MLP whose learning rate is too high kills its ReLU units.

``python -m benchmarks.monitor_picture [--out benchmarks/results]`` trains the MLP of the FOOF and
K-FAC sections on scikit-learn's digits with SGD at a learning rate well above the one that works,
logs a ``Monitor`` every few steps to JSON lines, and draws the log as the plot command does. The
inputs of the later layers turn to exact zeros (dead ReLU units) as the update-to-weight ratio
spikes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from inputaware_optim import InputAwareSGD, Monitor
from inputaware_optim.plot import plot

from .digits import load, models

PACKAGE = Path(__file__).resolve().parent


def run(out: Path, steps: int = 300, lr: float = 0.6, every: int = 5, seed: int = 0) -> Path:
    """Train, log and draw; returns the PNG's path."""
    torch.manual_seed(seed)
    data = load(seed, images=False)
    build, _, _ = models()["MLP"]
    model = build()
    optimizer = InputAwareSGD(model, lr=lr, momentum=0.9)
    out.mkdir(parents=True, exist_ok=True)
    folder = tempfile.TemporaryDirectory()
    log = Path(folder.name) / "monitor-digits-mlp.jsonl"
    monitor = Monitor(optimizer, every=every, jsonl=log)
    inputs, labels = data.train
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = torch.randint(0, len(labels), (64,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs[batch]), labels[batch]).backward()
        optimizer.step()
    monitor.remove()
    with folder:
        return plot(log, out / "picture-monitor-digits-mlp.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.monitor_picture", description=__doc__)
    parser.add_argument("--out", type=Path, default=PACKAGE / "results", help="folder of the PNG and its log")
    parser.add_argument("--lr", type=float, default=0.6, help="SGD learning rate (momentum 0.9; default 0.6)")
    args = parser.parse_args(argv)
    print(f"Wrote {run(args.out, lr=args.lr)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
