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
    ``torch.optim.SGD`` with the same flags. Override ``step(closure=None, inputs=None)``
    to write a rule that reads ``inputs.get(p)``.

    Args:
        model: The model (``torch.compile``\ d and ``DistributedDataParallel`` wrappers too).
        params: Parameters or param groups of ``model``; default: those requiring grad.
        storage: How captured tensors are kept: ``"reference"`` (zero-copy), ``"clone"``, ``"cpu"``.
        grad_outputs: Also capture each call's output gradients (default: the rule's choice).
        grad_scaler: The ``torch.amp.GradScaler`` the loss is scaled by, for rules that read output
            gradients (they are unscaled where they are read); such rules refuse a scaled step without it.
        strict: Refuse, at the first step, any parameter a rule would leave to the stock update.
        process_group: The group rules combine input statistics over; ``"infer"`` (default) reads it
            from the model's DDP wrapper or FSDP2 mesh, ``None`` keeps them per rank.
        base: Another stock ``torch.optim`` class whose ``step`` applies the update (bitwise that class
            fed the rule's gradient); every other keyword argument then goes to it.
    """

    _stock = torch.optim.SGD
