"""InputAwareSGD: ``torch.optim.SGD`` that sees the inputs that produced each gradient."""

from __future__ import annotations

import torch

from .base import InputAwareOptimizer

__all__ = ["InputAwareSGD"]


class InputAwareSGD(InputAwareOptimizer, torch.optim.SGD):
    r"""A drop-in ``torch.optim.SGD`` that captures each module's forward inputs.

    ``InputAwareSGD(model, params=None, lr=1e-3, momentum=0, dampening=0, weight_decay=0,
    nesterov=False, *, maximize=False, foreach=None, differentiable=False, fused=None,
    storage="reference", grad_outputs=None, grad_scaler=None, strict=False, process_group="infer",
    base=None)``

    Every hyperparameter is ``torch.optim.SGD``'s, with its name, default and validation,
    and the update is torch's own kernel: with no rule, every step is bitwise identical to
    ``torch.optim.SGD`` with the same flags. The other arguments are ``InputAwareOptimizer``'s.
    Override ``step(closure=None, inputs=None)`` to write a rule that reads ``inputs.get(p)``.
    """

    _stock = torch.optim.SGD
