"""InputAwareSGD: ``torch.optim.SGD`` that sees the inputs that produced each gradient."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .base import InputAwareOptimizer
from .coverage import warn_if_no_layers
from .rule import Rule

__all__ = ["InputAwareSGD", "SGDWithRule"]


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


class SGDWithRule(InputAwareSGD):
    """An optimizer made of one built-in rule, its update SGD with momentum (or ``base=``'s): FOOF, K-FAC,
    Eva and NLMS. ``rules=`` given to it chain after the rule's own."""

    def _construct(
        self,
        model: nn.Module,
        lr: float | None,
        momentum: float | None,
        rule: Rule,
        params: Any,
        kwargs: dict[str, Any],
        wanted: str = "layer with a registered Kronecker form (nn.Linear, nn.Conv2d, ...)",
        default_momentum: float | None = 0.9,
    ) -> None:
        if lr is None:
            raise TypeError(f"{type(self).__name__}(model, lr=...): the learning rate has no default; pass lr")
        base = kwargs.get("base")
        if base is None and (momentum is not None or default_momentum is not None):
            kwargs["momentum"] = default_momentum if momentum is None else momentum  # the rule's SGD default
        elif (
            base is not None and momentum is not None
        ):  # given: to a base that takes it (one that is not a class is refused below)
            if isinstance(base, type) and "momentum" not in inspect.signature(base).parameters:
                raise ValueError(f"momentum={momentum} is an argument of SGD; {base.__name__} has none")
            kwargs["momentum"] = momentum
        more = kwargs.pop("rules", ())
        more = [more] if isinstance(more, Rule) else list(more)
        InputAwareSGD.__init__(self, model, params, lr=lr, rules=[rule, *more], **kwargs)
        if rule.layers is not None:
            warn_if_no_layers(self, rule.layers, wanted)
