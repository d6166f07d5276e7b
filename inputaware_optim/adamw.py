"""InputAwareAdamW: ``torch.optim.AdamW`` that sees the inputs that produced each gradient."""

from __future__ import annotations

import torch

from .base import InputAwareOptimizer

__all__ = ["InputAwareAdamW"]


class InputAwareAdamW(InputAwareOptimizer, torch.optim.AdamW):
    r"""A drop-in ``torch.optim.AdamW`` that captures each module's forward inputs.

    ``InputAwareAdamW(model, params=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=1e-2, amsgrad=False, *, maximize=False, foreach=None, capturable=False,
    differentiable=False, fused=None, storage="reference", grad_outputs=None, grad_scaler=None,
    strict=False, process_group="infer", base=None)``

    Every hyperparameter is ``torch.optim.AdamW``'s, with its name, default and validation,
    and the update is torch's own kernel: with no rule, every step is bitwise identical to
    ``torch.optim.AdamW`` with the same flags. The other arguments are ``InputAwareOptimizer``'s.
    Override ``step(closure=None, inputs=None)`` to write a rule that reads ``inputs.get(p)``.
    """

    _stock = torch.optim.AdamW
