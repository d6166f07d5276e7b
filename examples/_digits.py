"""The scikit-learn digits (1,797 8x8 images, bundled with scikit-learn: no download), standardized."""

from __future__ import annotations

import torch


def digits(images: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: 1,500 training and 297 test digits, pixels standardized
    on the training set; flat 64-vectors, or ``(N, 1, 8, 8)`` images with ``images=True``."""
    from sklearn.datasets import load_digits

    x_all, y_all = load_digits(return_X_y=True)
    x = torch.tensor(x_all, dtype=torch.float32)
    y = torch.tensor(y_all)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    mean, std = x[:1500].mean(0), x[:1500].std(0) + 1e-3
    x = (x - mean) / std
    if images:
        x = x.reshape(-1, 1, 8, 8)
    return x[:1500], y[:1500], x[1500:], y[1500:]


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The fraction of ``x`` that ``model`` classifies as ``y``."""
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())
