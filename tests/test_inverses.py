"""How Kronecker rules invert their factors: Cholesky or a kept eigendecomposition, in float64 or float32."""

from __future__ import annotations

import copy
import io
import re
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from inputaware_optim import FOOF, KFAC, Eva
from inputaware_optim.inverses import INVERSES, ROUNDING_MARGIN, damped_inverse, eigenbasis, inverse_from_eigenbasis

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


# One contract for every inverse (inverses.py): a damped matrix is inverted only if its condition number is below
# 1 / (ROUNDING_MARGIN ε); else the step is refused, changing nothing. A step taken is within CONTRACT_TOLERANCE of
# the dense formula in float64 from the same rows and output gradients: 1 / ROUNDING_MARGIN where the inverse is
# formed in float64, 3 / ROUNDING_MARGIN where in float32 (inverse_dtype=torch.float32, and Eva's closed form).
# (Measured over 400 random cases of each: at most 6% and 18%.)
CONTRACT_TOLERANCE = {torch.float64: 1 / ROUNDING_MARGIN, torch.float32: 3 / ROUNDING_MARGIN}
CONTRACT_CASES = [
    pytest.param(rule, options, id="-".join([rule.__name__, *map(str, options.values())]).replace("torch.", ""))
    for rule, variants in (
        (FOOF, [{}]),
        (KFAC, [{"convention": "inputaware"}, {"convention": "kfac-pytorch"}]),
    )
    for variant in variants
    for options in (
        {**variant, "inverse": inverse, "inverse_dtype": dtype}
        for inverse in ("cholesky", "eigh")
        for dtype in (torch.float64, torch.float32)
    )
] + [pytest.param(Eva, {"damping_form": form}, id=f"Eva-{form}") for form in ("kronecker", "factors")]


def contract_reference(
    rule: type, options: dict[str, Any], rows: torch.Tensor, grads: torch.Tensor, damping: float
) -> torch.Tensor:
    """The preconditioned ``[∇W | ∇b]`` by the dense formula in float64, from the layer's input ``rows``
    (with ones) and output ``grads`` of a mean loss over ``len(rows)`` samples."""
    batch, matrix = len(rows), grads.T @ rows
    a, eye = rows.T @ rows / batch, (lambda n: torch.eye(n, dtype=torch.float64))
    if rule is FOOF:
        return torch.linalg.solve(a + damping * eye(len(a)), matrix.T).T
    kronecker = None
    if rule is Eva:
        mean_a, mean_g = rows.mean(0), grads.sum(0)  # ḡ: the mean per-example derivative B g
        if options["damping_form"] == "factors":
            left, right = torch.outer(mean_g, mean_g) + damping * eye(len(mean_g)), torch.outer(mean_a, mean_a)
            return torch.linalg.solve(left, matrix) @ torch.linalg.inv(right + damping * eye(len(mean_a)))
        kronecker = torch.kron(torch.outer(mean_g, mean_g), torch.outer(mean_a, mean_a))
    elif options["convention"] == "inputaware":
        g = batch * grads.T @ grads  # the second moment of Ds = B g
        pi = (a.diagonal().mean() / g.diagonal().mean()).sqrt()
        left, right = g + damping**0.5 / pi * eye(len(g)), a + pi * damping**0.5 * eye(len(a))
        return torch.linalg.solve(left, matrix) @ torch.linalg.inv(right)
    else:
        g = grads.T @ grads / batch
        if options["inverse"] == "cholesky":  # kfac-pytorch's "inverse": (G + λI)⁻¹ G̃ (A + λI)⁻¹
            return torch.linalg.solve(g + damping * eye(len(g)), matrix) @ torch.linalg.inv(a + damping * eye(len(a)))
        kronecker = torch.kron(g, a)  # its "eigen": (G ⊗ A + λI)⁻¹ vec G̃, row-major vec
    solved = torch.linalg.solve(kronecker + damping * eye(len(kronecker)), matrix.reshape(-1))
    return solved.reshape(matrix.shape)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
    """The parameters, their gradients and the rule's state (by parameter position and key), each tensor cloned."""
    positions = {p: i for i, p in enumerate(model.parameters())}
    state = sorted(
        (positions[p], key, value.clone() if isinstance(value, torch.Tensor) else value)
        for p, entries in optimizer.rules[0].state.items()  # type: ignore[attr-defined]
        for key, value in entries.items()
    )
    tensors = [t.detach().clone() for p in model.parameters() for t in (p, p.grad) if t is not None]
    return [*tensors, *state]


def assert_bitwise_equal(before: list[Any], after: list[Any]) -> None:
    assert len(before) == len(after)
    for old, new in zip(before, after, strict=True):
        if isinstance(old, torch.Tensor):
            assert torch.equal(old, new) and old.dtype == new.dtype
        elif isinstance(old, tuple):
            assert_bitwise_equal(list(old), list(new))
        else:
            assert old == new


def contract_step(
    rule: type, options: dict[str, Any], inputs: int, outputs: int, rows: int, damping: float, seed: int
) -> float | None:
    """A float32 ``Linear(inputs, outputs)`` stepped once at damping 1 on ``rows`` random rows (fewer than
    ``inputs + 1``: rank-deficient statistics), then on ``rows`` others at ``damping``: the relative error of
    that step's preconditioned gradient against ``contract_reference``, or ``None`` if it was refused, having
    changed no parameter, gradient or state."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(inputs, outputs))
    extra = {"kl_clip": None} if rule is Eva else {"update_every": 1}  # (Eva: its direction, not clipped)
    optimizer = rule(model, lr=1.0, momentum=0.0, damping=1.0, stat_decay=0.0, **extra, **options)
    generator = torch.Generator().manual_seed(seed)
    for step in range(2):
        x, y = torch.randn(rows, inputs, generator=generator), torch.randn(rows, outputs, generator=generator)
        optimizer.param_groups[0]["damping"] = 1.0 if step == 0 else damping
        optimizer.zero_grad()
        out = model(x)
        out.retain_grad()
        (out - y).pow(2).mean().backward()
        if step == 0:
            optimizer.step()
    before = snapshot(model, optimizer)
    try:
        optimizer.step()
    except RuntimeError as error:
        assert re.match(
            rf"the damped statistics of 0 \(.+\) are not positive definite \(damping={damping:g}", str(error)
        )
        assert "increase damping" in str(error) and "No parameter was changed by this step" in str(error)
        assert_bitwise_equal(before, snapshot(model, optimizer))
        return None
    layer = model[0]
    got = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1).double()
    expected = contract_reference(rule, options, with_ones(x).double(), out.grad.double(), damping)
    return float((got - expected).norm() / expected.norm())


@pytest.mark.parametrize(("rule", "options"), CONTRACT_CASES)
@settings(deadline=None)
@given(
    inputs=st.integers(2, 10),
    outputs=st.integers(1, 4),
    deficiency=st.integers(1, 10),
    exponent=st.floats(0.0, 12.0),
    seed=st.integers(0, 2**16),
)
@example(inputs=8, outputs=3, deficiency=5, exponent=8.0, seed=0)
@example(inputs=8, outputs=3, deficiency=5, exponent=10.0, seed=0)
@example(inputs=8, outputs=3, deficiency=5, exponent=12.0, seed=0)
@example(inputs=8, outputs=3, deficiency=8, exponent=12.0, seed=0)  # one row: rank one
def test_every_rule_steps_within_tolerance_of_the_float64_formula_or_refuses_changing_nothing(
    rule: type, options: dict[str, Any], inputs: int, outputs: int, deficiency: int, exponent: float, seed: int
) -> None:
    """Float32 layers on rank-deficient rows (``deficiency`` fewer than the ``inputs + 1`` columns, bias
    included), damping down to 1e-12: each step is within tolerance of the float64 formula, or refused."""
    rows = max(1, inputs + 1 - deficiency)
    error = contract_step(rule, options, inputs, outputs, rows, 10.0**-exponent, seed)
    assert error is None or error <= CONTRACT_TOLERANCE[options.get("inverse_dtype", torch.float32)], error


@pytest.mark.parametrize(("rule", "options"), [(FOOF, {}), (KFAC, {"convention": "inputaware"})], ids=["FOOF", "KFAC"])
@settings(deadline=None)
@given(
    inputs=st.integers(2, 10),
    deficiency=st.integers(1, 10),
    exponent=st.floats(0.0, 12.0),
    seed=st.integers(0, 2**16),
)
def test_cholesky_and_eigh_refuse_the_same_factors(
    rule: type, options: dict[str, Any], inputs: int, deficiency: int, exponent: float, seed: int
) -> None:
    rows, damping = max(1, inputs + 1 - deficiency), 10.0**-exponent
    refused = [contract_step(rule, {**options, "inverse": i}, inputs, 3, rows, damping, seed) is None for i in INVERSES]
    assert refused[0] == refused[1]


@pytest.mark.parametrize("between", ["update_every", "statistics_every"])
def test_a_damping_lowered_between_refreshes_is_refused_under_eigh_changing_nothing(between: str) -> None:
    """Under ``inverse="eigh"`` a new damping applies at the next step, from the kept eigendecomposition (no
    statistics this step, or no refresh): there too a damping below the contract is refused, before any change."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 2))
    optimizer = FOOF(model, lr=0.1, damping=1.0, inverse="eigh", **{between: 10})
    for damping in (1.0, 1e-12):
        optimizer.param_groups[0]["damping"] = damping
        optimizer.zero_grad()
        model(torch.randn(3, 6)).pow(2).mean().backward()  # 3 rows: a rank-3 factor of size 7
        if damping == 1.0:
            optimizer.step()
    before = snapshot(model, optimizer)
    with pytest.raises(RuntimeError, match=r"statistics of 0 \(input\) are not positive definite \(damping=1e-12\)"):
        optimizer.step()
    assert_bitwise_equal(before, snapshot(model, optimizer))
    optimizer.param_groups[0]["damping"] = 1e-3  # (within the contract: the same eigendecomposition, a new inverse)
    optimizer.step()
    state = optimizer.rules[0].state[model[0].weight]
    assert state["input_inverse_damping"] == 1e-3
