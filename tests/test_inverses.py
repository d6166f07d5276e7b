"""How Kronecker rules invert their factors: Cholesky or a kept eigendecomposition, in float64 or float32."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from inputaware_optim import FOOF, KFAC, Eva
from inputaware_optim.inverses import damped_inverse, eigenbasis, inverse_from_eigenbasis

from .references import backward_with_inputs, preconditioned_sgd_step, with_ones


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def batch(step: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, dampings: list[float]) -> None:
    for step, damping in enumerate(dampings):
        for group in optimizer.param_groups:
            group["damping"] = damping
        optimizer.zero_grad()
        model(batch(step)).pow(2).mean().backward()
        optimizer.step()


def foof_reference(
    model: nn.Sequential, dampings: list[float], update_every: int, lr: float, decay: float, eigh: bool
) -> None:
    """FOOF by hand, momentum 0: the running moment every step, its inverse refreshed every
    ``update_every`` steps. In between, Cholesky keeps the inverse (formed with the damping of
    its refresh); eigh keeps the refreshed moment and inverts it with the damping of the step."""
    layers = [model[0], model[2]]
    moments: dict[nn.Module, torch.Tensor] = {}
    refreshed: dict[nn.Module, torch.Tensor] = {}
    inverses: dict[nn.Module, torch.Tensor] = {}
    for step, damping in enumerate(dampings):
        inputs = backward_with_inputs(model, layers, lambda m, step=step: m(batch(step)).pow(2).mean())
        for layer in layers:
            rows = with_ones(inputs[layer].detach())
            moment = rows.T @ rows / len(rows)
            moments[layer] = moment if layer not in moments else decay * moments[layer] + (1 - decay) * moment
            identity = torch.eye(len(moment), dtype=torch.float64)
            if step % update_every == 0:
                refreshed[layer] = moments[layer]
                inverses[layer] = torch.linalg.inv(moments[layer] + damping * identity)
            elif eigh:
                inverses[layer] = torch.linalg.inv(refreshed[layer] + damping * identity)
            preconditioned_sgd_step(layer, inverses[layer], lr)


@pytest.mark.parametrize("inverse", ["cholesky", "eigh"])
def test_a_damping_change_applies_at_the_next_refresh_or_with_eigh_at_the_next_step(inverse: str) -> None:
    dampings = [0.1, 0.1, 0.5, 0.5, 0.02, 0.3, 0.3, 1.0]
    model, reference = net(), net()
    train(model, FOOF(model, lr=0.1, momentum=0.0, update_every=3, stat_decay=0.8, inverse=inverse), dampings)
    foof_reference(reference, dampings, update_every=3, lr=0.1, decay=0.8, eigh=inverse == "eigh")
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rule", [FOOF, KFAC])
def test_eigh_and_cholesky_give_the_same_steps_at_a_fixed_damping(rule: type) -> None:
    trained = []
    for inverse in ("cholesky", "eigh"):
        model = net()
        optimizer = rule(model, lr=0.1, update_every=2, statistics_every=2, inverse=inverse)
        train(model, optimizer, [0.1] * 7)
        trained.append([p.detach().clone() for p in model.parameters()])
        if inverse == "eigh":
            state = optimizer.rules[0].state[model[0].weight]
            assert state["input_eigenvectors"].dtype == torch.float64
            assert state["input_inverse_damping"] == optimizer.param_groups[0]["damping"]  # the group's, as given
    for p, q in zip(*trained, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("inverse", ["cholesky", "eigh"])
def test_float32_inverses_are_close_to_float64_ones(inverse: str) -> None:
    trained = []
    for dtype in (torch.float64, torch.float32):
        model = net()
        optimizer = KFAC(model, lr=0.1, update_every=1, inverse=inverse, inverse_dtype=dtype)
        train(model, optimizer, [1.0] * 5)  # (at 0.1 of the mean eigenvalue these steps grow 20-fold)
        trained.append([p.detach().clone() for p in model.parameters()])
        assert (
            optimizer.rules[0].state[model[0].weight]["input_inverse"].dtype == torch.float64
        )  # the statistics' dtype
    for p, q in zip(*trained, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert not torch.equal(p, q)  # float32 did run (rounding shows in the last bits)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 7),
    blocks=st.integers(1, 3),
    rank=st.integers(0, 7),
    damping=st.floats(1e-3, 10.0),
    seed=st.integers(0, 2**16),
)
def test_the_inverse_from_an_eigendecomposition_is_the_damped_inverse(
    n: int, blocks: int, rank: int, damping: float, seed: int
) -> None:
    x = torch.randn(blocks, rank, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    moment = x.mT @ x / max(rank, 1)  # positive semidefinite, singular when rank < n
    packed = eigenbasis(moment, "layer")
    assert packed.shape == (blocks, n + 1, n)
    inverse = inverse_from_eigenbasis(packed[..., -1, :], packed[..., :-1, :], damping, "layer", torch.float64)
    expected = torch.linalg.inv(moment + damping * torch.eye(n, dtype=torch.float64))
    torch.testing.assert_close(inverse, expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(damped_inverse(moment, damping, "layer"), expected, rtol=1e-9, atol=1e-9)


def test_eigh_refuses_a_singular_factor_without_damping_and_changes_nothing() -> None:
    model = net()
    optimizer = FOOF(model, lr=0.1, damping=0.0, inverse="eigh")
    before = [p.detach().clone() for p in model.parameters()]
    model.zero_grad()
    model(batch(0)[:2]).pow(2).mean().backward()  # 2 rows: a rank-2 factor of size 5
    with pytest.raises(RuntimeError, match=r"statistics of 0 \(input\) are not positive definite.*increase damping"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    model.zero_grad()
    model(batch(1)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r"statistics of 2 \(input\) are not finite"):
        optimizer.step()


def test_eigh_state_round_trips_through_state_dict() -> None:
    model = net()
    optimizer = KFAC(model, lr=0.1, update_every=3, inverse="eigh")
    train(model, optimizer, [0.1, 0.1])
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    twin = copy.deepcopy(model)
    resumed = KFAC(twin, lr=0.1, update_every=3, inverse="eigh")
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    dampings = [0.1, 0.4, 0.4, 0.2]  # changes between refreshes: formed from the loaded eigenbasis
    for step, damping in enumerate(dampings, start=2):
        for m, o in ((model, optimizer), (twin, resumed)):
            o.param_groups[0]["damping"] = damping
            o.zero_grad()
            m(batch(step)).pow(2).mean().backward()
            o.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_inverse_options_are_validated_by_name() -> None:
    with pytest.raises(ValueError, match=r"Invalid inverse: 'qr'"):
        FOOF(net(), lr=0.1, inverse="qr")
    with pytest.raises(ValueError, match=r"Invalid inverse_dtype: torch\.float16"):
        KFAC(net(), lr=0.1, inverse_dtype=torch.float16)
    for foreign in ({"inverse": "eigh"}, {"inverse_dtype": torch.float32}, {"update_every": 5}):
        with pytest.raises(TypeError, match=rf"Eva\(\) got {next(iter(foreign))}=: Eva inverts no matrix"):
            Eva(net(), lr=0.1, **foreign)


@pytest.mark.parametrize("rule", [FOOF, KFAC])
@pytest.mark.parametrize("inverse", ["cholesky", "eigh"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_gradient_that_is_not_finite_is_said_before_any_advice_on_damping(
    rule: type, inverse: str, bad: float
) -> None:
    """A diverged step (a gradient of inf or NaN) on a factor the damping cannot make invertible
    (damping 0, fewer rows than its size) is reported as divergence, naming the layer, not as
    "increase damping"; and nothing changes."""
    model = net()
    optimizer = rule(model, lr=0.1, damping=0.0, inverse=inverse)
    model.zero_grad()
    model(batch(0)[:2]).pow(2).mean().backward()  # 2 rows: singular factors
    assert model[2].bias.grad is not None
    model[2].bias.grad[0] = bad
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        RuntimeError, match=r"^the gradient of 2 is not finite: training has diverged.*learning rate"
    ) as error:
        optimizer.step()
    assert "not positive definite" in str(error.value.__cause__)  # (what it was before: kept as the cause)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("rule", [FOOF, KFAC])
def test_statistics_beyond_the_damping_s_rounding_say_so_and_kfac_names_the_damping_given(rule: type) -> None:
    """Inputs of 1e9 (a diverging run): the factor's rounding error exceeds the damping, and the
    message says so. K-FAC names the damping the user gave (0.01), then what it added to the factor
    (it said "damping=0.1", its square root, before)."""
    model = net()
    optimizer = rule(model, lr=0.1, damping=1e-2)
    model.zero_grad()
    model(batch(0)[:3] * 1e9).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r"not positive definite \(damping=0\.01[,)]") as error:
        optimizer.step()
    message = str(error.value)
    assert "below their rounding error" in message and "lower the learning rate" in message
    if rule is KFAC:
        assert "damping=0.01, added to this factor's diagonal as " in message
