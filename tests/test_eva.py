"""Eva against the paper's formula (a dense solve with the explicit Kronecker product, float64), and its bookkeeping."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from inputaware_optim import Eva
from inputaware_optim.eva import eva_direction, per_factor_direction


@pytest.fixture(autouse=True)
def _float64() -> Iterator[None]:
    """Every model and tensor of this file in float64, for tight comparisons."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def dense_eva_direction(matrix: torch.Tensor, a: torch.Tensor, g: torch.Tensor, damping: float) -> torch.Tensor:
    """``(ḡḡᵀ ⊗ āāᵀ + γI)⁻¹ vec M`` by ``torch.linalg.solve`` on the explicit Kronecker matrix
    (row-major vec: ``(ḡḡᵀ ⊗ āāᵀ) vec M = vec(ḡḡᵀ M āāᵀ)``), the form of the paper and of its authors' code."""
    kronecker = torch.kron(torch.outer(g, g), torch.outer(a, a))
    identity = torch.eye(len(kronecker), dtype=torch.float64)
    return torch.linalg.solve(kronecker + damping * identity, matrix.reshape(-1)).reshape(matrix.shape)


@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 6),
    blocks=st.sampled_from([(), (1,), (3,)]),
    damping=st.floats(1e-3, 10.0),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_sherman_morrison_equals_the_dense_kronecker_solve(
    rows: int, cols: int, blocks: tuple[int, ...], damping: float, seed: int
) -> None:
    """A matrix, or a stack of blocks (a grouped convolution), each with its own vectors."""
    generator = torch.Generator().manual_seed(seed)
    matrix = torch.randn(*blocks, rows, cols, generator=generator, dtype=torch.float64)
    a = torch.randn(*blocks, cols, generator=generator, dtype=torch.float64)
    g = torch.randn(*blocks, rows, generator=generator, dtype=torch.float64)
    direction = eva_direction(matrix, a, g, damping)
    assert direction.shape == matrix.shape
    flat = (matrix.reshape(-1, rows, cols), a.reshape(-1, cols), g.reshape(-1, rows))
    expected = torch.stack([dense_eva_direction(m, u, v, damping) for m, u, v in zip(*flat, strict=True)])
    torch.testing.assert_close(direction, expected.reshape(matrix.shape), rtol=1e-9, atol=1e-9)


def _reference_step(
    model: nn.Sequential,
    x: torch.Tensor,
    y: torch.Tensor,
    state: dict[int, tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    damping: float,
    decay: float,
    kl_clip: float | None,
) -> None:
    """One Eva step from the paper's formulas: vectors from the inputs and retained output gradients."""
    layers = [m for m in model if isinstance(m, nn.Linear)]
    inputs, outputs = {}, {}

    def keep(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        inputs[module] = args[0]
        output.retain_grad()
        outputs[module] = output

    handles = [m.register_forward_hook(keep) for m in layers]
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()  # a mean over the batch and the outputs
    for handle in handles:
        handle.remove()
    batch = x.shape[0]
    directions = []
    for layer in layers:
        rows = torch.cat([inputs[layer], torch.ones(batch, 1)], dim=1)
        a = rows.mean(0)
        g = (batch * outputs[layer].grad).mean(0)  # the mean per-example derivative Ds = B g
        if id(layer) in state:
            old_a, old_g = state[id(layer)]
            a, g = decay * old_a + (1 - decay) * a, decay * old_g + (1 - decay) * g
        state[id(layer)] = (a, g)
        grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
        directions.append((layer, dense_eva_direction(grad, a, g, damping), grad))
    total = sum(float((p * grad).sum().detach()) for _, p, grad in directions) * lr * lr
    nu = 1.0 if kl_clip is None else min(1.0, math.sqrt(kl_clip / abs(total)))
    with torch.no_grad():
        for layer, p, _ in directions:
            layer.weight -= lr * nu * p[:, :-1]
            layer.bias -= lr * nu * p[:, -1]


def _train_beside_the_reference(
    model: nn.Module, optimizer: Eva, reference: nn.Module, kl_clip: float | None
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Three steps of ``optimizer`` and of the paper's recursion on ``reference`` (lr 0.1, damping 0.5,
    decay 0.9), the parameters compared after each; the reference's vectors."""
    state: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for _ in range(3):
        x, y = torch.randn(8, 5), torch.randn(8, 3)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        _reference_step(reference, x, y, state, lr=0.1, damping=0.5, decay=0.9, kl_clip=kl_clip)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    return state


@pytest.mark.parametrize("kl_clip", [None, 1e-3])
def test_steps_equal_the_papers_formula(kl_clip: float | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    reference = copy.deepcopy(model)
    optimizer = Eva(model, lr=0.1, momentum=0.0, damping=0.5, stat_decay=0.9, kl_clip=kl_clip)
    state = _train_beside_the_reference(model, optimizer, reference, kl_clip)
    a, g = state[id(reference[0])]
    torch.testing.assert_close(optimizer.rules[0].state[model[0].weight]["input_mean"], a)
    torch.testing.assert_close(optimizer.rules[0].state[model[0].weight]["output_grad_mean"], g)
    assert optimizer.rules[0].state[model[0].weight]["statistics_steps"] == 3


@pytest.mark.parametrize("split", ["per layer", "weights and biases"])
def test_the_kl_clip_is_one_scale_over_every_layer_however_the_groups_are_split(split: str) -> None:
    """The paper's one ``nu`` over all layers: param groups with the same hyperparameters give the
    one-group result (the scale was per group, so splitting groups changed the update by 9%)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    reference = copy.deepcopy(model)
    if split == "per layer":
        groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}]
    else:
        groups = [{"params": [model[0].weight, model[2].weight]}, {"params": [model[0].bias, model[2].bias]}]
    optimizer = Eva(model, lr=0.1, momentum=0.0, damping=0.5, stat_decay=0.9, kl_clip=1e-3, params=groups)
    _train_beside_the_reference(model, optimizer, reference, 1e-3)


def test_param_groups_with_different_kl_clips_are_refused_before_any_change() -> None:
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "kl_clip": 0.01}]
    optimizer = Eva(model, lr=0.1, params=groups)
    before = [p.detach().clone() for p in model.parameters()]
    nn.functional.mse_loss(model(torch.randn(8, 5)), torch.randn(8, 3)).backward()
    with pytest.raises(ValueError, match=r"same value .*\[0.001, 0.01\]"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_gradient_accumulation_equals_the_concatenated_batch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    whole = copy.deepcopy(model)
    split, joint = Eva(model, lr=0.05), Eva(whole, lr=0.05)
    for _ in range(2):
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        split.zero_grad()
        for part in (slice(0, 3), slice(3, 8)):  # unequal micro-batches, each a sum over its samples / 8
            (nn.functional.mse_loss(model(x[part]), y[part], reduction="sum") / (8 * 2)).backward()
        split.step()
        joint.zero_grad()
        nn.functional.mse_loss(whole(x), y).backward()
        joint.step()
    for p, q in zip(model.parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_conv_layers_are_preconditioned_and_hold_only_vectors() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    optimizer = Eva(model, lr=0.1)
    nn.functional.mse_loss(model(torch.randn(4, 2, 6, 6)), torch.randn(4, 2)).backward()
    held = optimizer.capture.reduced(optimizer.rules[0]._statistics)
    sizes = {tuple(torch.as_tensor(t).shape) for totals in held.values() for pair in totals.values() for t in pair}
    assert sizes <= {(2 * 9 + 1,), (3,), (3 * 16 + 1,), (2,), ()}  # vectors and counts, never a matrix
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert {"input_mean", "output_grad_mean"} <= set(optimizer.rules[0].state[model[0].weight])
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"damping": 0.0}, "damping"),
        ({"kl_clip": 0.0}, "kl_clip"),
        ({"kl_clip": math.inf}, "kl_clip"),
        ({"stat_decay": 1.0}, "stat_decay"),
        ({"loss_reduction": "yes"}, "loss_reduction"),
    ],
)
def test_bad_configuration_names_the_argument(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Eva(nn.Linear(2, 2), lr=0.1, **kwargs)  # type: ignore[arg-type]


def test_lr_has_no_default() -> None:
    with pytest.raises(TypeError, match=r"Eva\(model, lr=\.\.\.\)"):
        Eva(nn.Linear(2, 2))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_direction_is_refused_by_name_and_nothing_changes(bad: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    optimizer = Eva(model, lr=0.1, kl_clip=None)
    nn.functional.mse_loss(model(torch.randn(5, 3)), torch.randn(5, 2)).backward()
    assert model[2].weight.grad is not None
    model[2].weight.grad[0, 0] = bad
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with pytest.raises(RuntimeError, match=r"gradient of 2 is not finite"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)


def test_a_direction_whose_squares_overflow_is_still_taken() -> None:
    """The finiteness check's norm overflows on large finite values: those are not refused."""
    torch.set_default_dtype(torch.float32)  # (this file's fixture set float64; it restores it)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = Eva(model, lr=1e-30, momentum=0.0, kl_clip=None)
    nn.functional.mse_loss(model(torch.randn(4, 3)), torch.randn(4, 2)).backward()
    assert model.weight.grad is not None
    model.weight.grad.fill_(1e30)  # finite; its squares are not (float32)
    before = model.weight.detach().clone()
    optimizer.step()
    assert torch.isfinite(model.weight).all() and not torch.equal(model.weight, before)


@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 6),
    blocks=st.sampled_from([(), (3,)]),
    damping=st.floats(1e-3, 10.0),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=30, deadline=None)
def test_the_per_factor_form_equals_the_explicit_inverses(
    rows: int, cols: int, blocks: tuple[int, ...], damping: float, seed: int
) -> None:
    """``damping_form="factors"``: ``(ḡḡᵀ + γI)⁻¹ M (āāᵀ + γI)⁻¹`` against ``torch.linalg.inv``."""
    generator = torch.Generator().manual_seed(seed)
    matrix = torch.randn(*blocks, rows, cols, generator=generator, dtype=torch.float64)
    a = torch.randn(*blocks, cols, generator=generator, dtype=torch.float64)
    g = torch.randn(*blocks, rows, generator=generator, dtype=torch.float64)
    left = torch.linalg.inv(g[..., :, None] * g[..., None, :] + damping * torch.eye(rows, dtype=torch.float64))
    right = torch.linalg.inv(a[..., :, None] * a[..., None, :] + damping * torch.eye(cols, dtype=torch.float64))
    torch.testing.assert_close(per_factor_direction(matrix, a, g, damping), left @ matrix @ right, rtol=1e-9, atol=1e-9)


def test_the_damping_form_is_chosen_by_name() -> None:
    torch.manual_seed(0)
    steps = {}
    for form in ("kronecker", "factors"):
        model = nn.Linear(3, 2)
        optimizer = Eva(model, lr=0.1, momentum=0.0, kl_clip=None, damping_form=form)
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
        nn.functional.mse_loss(model(x), torch.zeros(4, 2)).backward()
        grad = torch.cat([model.weight.grad, model.bias.grad[:, None]], dim=1)
        a = torch.cat([x, torch.ones(4, 1)], dim=1).mean(0)
        g = (4 * 2 * model(x).detach() / 8).mean(0)  # Ds = B g, g the gradient of the mean loss at the output
        before = torch.cat([model.weight, model.bias[:, None]], dim=1).detach().clone()
        optimizer.step()
        steps[form] = (before - torch.cat([model.weight, model.bias[:, None]], dim=1).detach()) / 0.1
        reference = dense_eva_direction if form == "kronecker" else per_factor_direction
        torch.testing.assert_close(steps[form], reference(grad, a, g, 0.03), rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match=r"Invalid damping_form: 'both'"):
        Eva(nn.Linear(2, 2), lr=0.1, damping_form="both")


def test_bfloat16_parameters_are_preconditioned_in_float32() -> None:
    """For a bfloat16 layer the closed form runs in float32, rounded once into the gradient (as FOOF's and
    K-FAC's products): in bfloat16, 55% of this gradient's entries differed, by up to 49%."""
    torch.manual_seed(0)
    layer = nn.Linear(24, 16).to(torch.bfloat16)
    x = torch.randn(64, 24, dtype=torch.bfloat16)
    optimizer = Eva(layer, lr=1e-3, momentum=0.0, kl_clip=None)
    layer(x).float().pow(2).sum().backward()
    raw = torch.cat([layer.weight.grad, layer.bias.grad.unsqueeze(1)], dim=1).float()
    optimizer.step()
    state = optimizer.rules[0].state[layer.weight]
    a, g = state["input_mean"], state["output_grad_mean"]
    assert a.dtype == g.dtype == torch.float32
    got = torch.cat([layer.weight.grad, layer.bias.grad.unsqueeze(1)], dim=1)
    torch.testing.assert_close(got, eva_direction(raw, a, g, 0.03).bfloat16(), rtol=0, atol=0)
