"""Shared test settings and small models."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from torch import nn

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "30")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)
settings.load_profile("ci")
torch.set_num_threads(2)


def mlp(seed: int = 0, width: int = 8) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3))


@pytest.fixture
def model() -> nn.Sequential:
    return mlp()


def hooks_on(model: nn.Module) -> int:
    """How many forward hooks and pre-hooks sit on the modules of ``model``."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
