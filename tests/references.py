"""Reference computations written out the slow, obvious way, for tests to compare against."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def conv_patches(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Patch rows by explicit slicing: one row per (sample, output position), as the convolution sees them."""
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    x = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
    out_h = (x.shape[2] - dh * (kh - 1) - 1) // sh + 1
    out_w = (x.shape[3] - dw * (kw - 1) - 1) // sw + 1
    rows = []
    for b in range(x.shape[0]):
        for i in range(out_h):
            for j in range(out_w):
                patch = x[b, :, i * sh : i * sh + dh * (kh - 1) + 1 : dh, j * sw : j * sw + dw * (kw - 1) + 1 : dw]
                rows.append(patch.reshape(-1))
    return torch.stack(rows)


def with_ones(rows: torch.Tensor) -> torch.Tensor:
    return torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], dim=1)


def output_grads(model: nn.Module, modules: list[nn.Module], loss_of: Any) -> list[torch.Tensor]:
    """The gradient reaching each listed module's output (retain_grad), for ``loss_of(model)``."""
    outputs: list[torch.Tensor] = []

    def keep(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        output.retain_grad()
        outputs.append(output)

    handles = [m.register_forward_hook(keep) for m in modules]
    loss_of(model).backward()
    for handle in handles:
        handle.remove()
    model.zero_grad()
    return [o.grad for o in outputs]


def backward_with_inputs(model: nn.Module, modules: list[nn.Module], loss_of: Any) -> dict[nn.Module, torch.Tensor]:
    """Zero ``model``'s gradients, backpropagate ``loss_of(model)`` and return the input each listed
    module received (its first argument; the gradients stay for the caller's step)."""
    inputs: dict[nn.Module, torch.Tensor] = {}

    def keep(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        inputs[module] = args[0]

    handles = [m.register_forward_hook(keep) for m in modules]
    model.zero_grad()
    loss_of(model).backward()
    for handle in handles:
        handle.remove()
    return inputs


def preconditioned_sgd_step(layer: nn.Linear, inverse: torch.Tensor, lr: float) -> None:
    """``[W | b] -= lr * [∇W | ∇b] inverse``: FOOF's update without momentum, by hand."""
    assert layer.weight.grad is not None and layer.bias.grad is not None
    with torch.no_grad():
        grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1) @ inverse
        layer.weight -= lr * grad[:, :-1]
        layer.bias -= lr * grad[:, -1]
