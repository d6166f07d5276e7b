"""The stock baselines a user would pick today, as the benchmarks configure them: Muon beside AdamW.

``muon(model, lr)`` is the standard recipe (Keller Jordan's; Moonshot's "Muon is Scalable"):
Muon for the hidden layers' 2-D weights, AdamW for everything else: embeddings, the first and
the last (output) layer, norms, biases, and convolution kernels. Both read one learning rate:
Muon scales its update to AdamW's RMS (``adjust_lr_fn="match_rms_adamw"``), so the rate of a
sweep means the same to both parts, and both decay weights by AdamW's default (0.01).

What counts as hidden: the weight of an ``nn.Linear`` that is neither the model's first nor
its last module holding parameters (the input layer or embedding, and the head). Convolution
kernels go to AdamW: ``torch.optim.Muon`` takes 2-D parameters only, and one recipe for both
implementations below keeps them comparable.

Two implementations of the same update:

- ``torch.optim.Muon`` as shipped runs its Newton–Schulz iteration in ``bfloat16``, made for
  GPUs; on a CPU without native bfloat16 matrix products it is emulated and costs seconds per
  step at the GPT workload's size (hundreds of times AdamW's step). Timed as shipped.
- ``Float32Muon``: the same update with Newton–Schulz in ``float32`` (the parameters' dtype),
  the way a CPU user would run Muon. Tested against ``torch.optim.Muon`` to ``bfloat16``'s
  precision (``tests/test_baselines.py``); the training runs use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ABOUT", "WEIGHT_DECAY", "Combined", "Float32Muon", "hidden_matrices", "muon", "newton_schulz"]

WEIGHT_DECAY = 0.01  # torch.optim.AdamW's default, for both parts
ABOUT = (
    "Muon (momentum 0.95, Nesterov, 5 Newton–Schulz steps in float32, update scaled to AdamW's RMS) on the "
    "hidden layers' 2-D weights, torch.optim.AdamW on the rest (embeddings, first and last layer, conv kernels, "
    "norms, biases), one learning rate, weight decay 0.01"
)


def hidden_matrices(model: nn.Module) -> list[Tensor]:
    """The 2-D weights of the ``nn.Linear`` layers between the model's first and last parameterized module."""
    holders = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    inner = holders[1:-1]
    return [m.weight for m in inner if isinstance(m, nn.Linear)]


def newton_schulz(update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> Tensor:
    """``torch.optim.Muon``'s quintic Newton–Schulz orthogonalization of a matrix, in the update's dtype."""
    a, b, c = coefficients
    tall = update.size(0) > update.size(1)
    x = update.T if tall else update
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """``torch.optim.Muon``'s learning-rate adjustment for a matrix of ``shape``."""
    rows, columns = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * max(1.0, rows / columns) ** 0.5
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * max(rows, columns) ** 0.5
    return lr


class Float32Muon(torch.optim.Muon):
    """``torch.optim.Muon`` with its Newton–Schulz iteration in the gradient's dtype instead of ``bfloat16``.

    Same arguments, state (``momentum_buffer``) and update; only the precision of the
    orthogonalization differs (``float32`` for ``float32`` parameters).
    """

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            momentum = group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
                buffer = state["momentum_buffer"]
                buffer.lerp_(param.grad, 1 - momentum)
                update = param.grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(update, alpha=-_adjusted_lr(group["lr"], group["adjust_lr_fn"], param.shape))
        return loss


class Combined(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, stepped as one: what a training loop holds.

    ``param_groups`` are the parts' own groups (a scheduler setting ``lr`` sets it in the part);
    ``step`` steps each part in turn; ``state_dict`` is the parts' state dicts.
    """

    def __init__(self, parts: Iterable[torch.optim.Optimizer]) -> None:
        self.parts = [part for part in parts if part.param_groups]
        if not self.parts:
            raise ValueError("Combined needs at least one optimizer with parameters")
        super().__init__([p for part in self.parts for group in part.param_groups for p in group["params"]], {})
        self.param_groups = [group for part in self.parts for group in part.param_groups]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, state in zip(self.parts, state_dict["parts"], strict=True):
            part.load_state_dict(state)


def muon(model: nn.Module, lr: float, implementation: Callable[..., torch.optim.Optimizer] = Float32Muon) -> Combined:
    """Muon on ``hidden_matrices(model)``, ``torch.optim.AdamW`` on the rest, one learning rate for both.

    Args:
        model: The model whose parameters are trained.
        lr: The learning rate of both parts (Muon's scaled to AdamW's RMS).
        implementation: ``Float32Muon`` (the default), ``torch.optim.Muon`` as shipped, or what builds
            the hidden part from ``(params, lr=, weight_decay=, adjust_lr_fn=)`` (a rule in front of Muon).
    """
    hidden = hidden_matrices(model)
    chosen = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in chosen]
    parts: list[torch.optim.Optimizer] = []
    if hidden:
        parts.append(implementation(hidden, lr=lr, weight_decay=WEIGHT_DECAY, adjust_lr_fn="match_rms_adamw"))
    if rest:
        parts.append(torch.optim.AdamW(rest, lr=lr, weight_decay=WEIGHT_DECAY))
    return Combined(parts)
