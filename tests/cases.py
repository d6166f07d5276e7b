"""The database of drop-in cases: each input-aware optimizer beside its stock twin."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st

from inputaware_optim import InputAwareAdamW, InputAwareSGD


@dataclass(frozen=True)
class DropInCase:
    name: str
    cls: type
    stock: type
    hyperparameters: st.SearchStrategy[dict[str, Any]]
    state_keys: tuple[str, ...] = field(default=())


@st.composite
def sgd_hyperparameters(draw: st.DrawFn) -> dict[str, Any]:
    momentum = draw(st.sampled_from([0.0, 0.5, 0.9]) | st.floats(0.0, 0.99))
    nesterov = momentum > 0 and draw(st.booleans())
    dampening = 0.0 if nesterov else draw(st.sampled_from([0.0, 0.1]) | st.floats(0.0, 0.5))
    return {
        "lr": draw(st.floats(1e-4, 1.0)),
        "momentum": momentum,
        "dampening": dampening,
        "nesterov": nesterov,
        "weight_decay": draw(st.sampled_from([0.0, 1e-2]) | st.floats(0.0, 0.1)),
        "maximize": draw(st.booleans()),
    }


@st.composite
def adamw_hyperparameters(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "lr": draw(st.floats(1e-4, 1e-1)),
        "betas": (draw(st.floats(0.0, 0.99)), draw(st.floats(0.9, 0.9999))),
        "eps": draw(st.sampled_from([1e-8, 1e-6]) | st.floats(1e-10, 1e-6)),
        "weight_decay": draw(st.sampled_from([0.0, 1e-2]) | st.floats(0.0, 0.1)),
        "amsgrad": draw(st.booleans()),
        "maximize": draw(st.booleans()),
    }


DROP_IN_CASES = [
    DropInCase("sgd", InputAwareSGD, torch.optim.SGD, sgd_hyperparameters(), ("momentum_buffer",)),
    DropInCase("adamw", InputAwareAdamW, torch.optim.AdamW, adamw_hyperparameters(), ("step", "exp_avg", "exp_avg_sq")),
]

# The implementation flags torch offers on CPU for both: the for-loop kernel, foreach, fused.
IMPLEMENTATIONS = {
    "for-loop": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}
