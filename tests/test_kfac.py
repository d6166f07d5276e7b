"""K-FAC against the explicit solve with the dense Kronecker product, built in float64."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from inputaware_optim import KFAC

from .references import conv_patches, output_grads, with_ones


def dense_kronecker_step(grad: torch.Tensor, a: torch.Tensor, g: torch.Tensor, damping: float) -> torch.Tensor:
    """Solve (A_d ⊗ G_d) vec(U) = vec(grad) with the Kronecker product materialized (vec: column-major),
    with Martens & Grosse's factored damping: A_d = A + π√λ I, G_d = G + √λ/π I, π² the ratio of
    the factors' mean eigenvalues."""
    eye_a, eye_g = torch.eye(a.shape[0], dtype=a.dtype), torch.eye(g.shape[0], dtype=g.dtype)
    pi = (torch.linalg.eigvalsh(a).mean() / torch.linalg.eigvalsh(g).mean()).sqrt()
    kron = torch.kron(a + pi * math.sqrt(damping) * eye_a, g + math.sqrt(damping) / pi * eye_g)
    solution = torch.linalg.solve(kron, grad.T.reshape(-1))
    return solution.reshape(grad.shape[1], grad.shape[0]).T


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 4 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


def test_preconditioned_gradient_equals_the_dense_kronecker_solve() -> None:
    model = Net().double()
    x = torch.randn(5, 2, 4, 4, dtype=torch.float64)
    target = torch.randn(5, 4, dtype=torch.float64)

    def loss_of(m: nn.Module) -> torch.Tensor:
        return 0.5 * (m(x) - target).pow(2).sum(dim=1).mean()

    conv_g, fc_g = output_grads(model, [model.conv, model.fc], loss_of)
    damping = 1e-2
    optimizer = KFAC(model, lr=1.0, momentum=0.0, damping=damping)
    loss_of(model).backward()
    grads = {
        "conv": torch.cat([model.conv.weight.grad.reshape(3, -1), model.conv.bias.grad[:, None]], 1),
        "fc": torch.cat([model.fc.weight.grad, model.fc.bias.grad[:, None]], 1),
    }
    with torch.no_grad():
        hidden = torch.tanh(model.conv(x)).flatten(1)
    rows = {"conv": with_ones(conv_patches(model.conv, x)), "fc": with_ones(hidden)}
    ds = {  # per-example output derivatives: the loss is a mean over 5 samples
        "conv": 5 * conv_g.permute(0, 2, 3, 1).reshape(-1, 3),
        "fc": 5 * fc_g,
    }
    expected = {}
    for name in ("conv", "fc"):
        a = rows[name].T @ rows[name] / rows[name].shape[0]
        g = ds[name].T @ ds[name] / 5  # E over examples of the sum over positions
        expected[name] = dense_kronecker_step(grads[name], a, g, damping)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    steps = {n: before[n] - p.detach() for n, p in model.named_parameters()}
    torch.testing.assert_close(steps["conv.weight"].reshape(3, -1), expected["conv"][:, :-1])
    torch.testing.assert_close(steps["conv.bias"], expected["conv"][:, -1])
    torch.testing.assert_close(steps["fc.weight"], expected["fc"][:, :-1])
    torch.testing.assert_close(steps["fc.bias"], expected["fc"][:, -1])


def run(model: nn.Module, optimizer: Any, steps: list[list[torch.Tensor]], reduction: str = "mean") -> None:
    for micro_batches in steps:
        optimizer.zero_grad()
        for x in micro_batches:
            out = model(x).pow(2).sum(dim=1)
            loss = out.mean() / len(micro_batches) if reduction == "mean" else out.sum()
            loss.backward()
        optimizer.step()


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def test_gradient_accumulation_equals_the_concatenated_batch() -> None:
    generator = torch.Generator().manual_seed(0)
    micro = [[torch.randn(3, 4, generator=generator, dtype=torch.float64) for _ in range(3)] for _ in range(3)]
    a, b = mlp(), mlp()
    oa, ob = KFAC(a, lr=0.1, update_every=2), KFAC(b, lr=0.1, update_every=2)
    run(a, oa, micro)
    run(b, ob, [[torch.cat(m)] for m in micro])
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    for key in ("input_inverse", "output_grad_inverse"):
        torch.testing.assert_close(oa.rules[0].state[a[0].weight][key], ob.rules[0].state[b[0].weight][key])


@given(batch=st.integers(2, 6))
def test_a_summed_loss_gives_the_same_factors_and_a_batch_times_larger_step(batch: int) -> None:
    x = torch.randn(batch, 4, generator=torch.Generator().manual_seed(batch), dtype=torch.float64)
    mean_model, sum_model = mlp(), mlp()
    mean_opt = KFAC(mean_model, lr=0.1, momentum=0.0)
    sum_opt = KFAC(sum_model, lr=0.1 / batch, momentum=0.0, loss_reduction="sum")
    run(mean_model, mean_opt, [[x]], "mean")
    run(sum_model, sum_opt, [[x]], "sum")
    for p, q in zip(mean_model.parameters(), sum_model.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    torch.testing.assert_close(
        mean_opt.rules[0].state[mean_model[2].weight]["output_grad_second_moment"],
        sum_opt.rules[0].state[sum_model[2].weight]["output_grad_second_moment"],
    )


def test_captures_output_gradients_by_itself_and_validates() -> None:
    optimizer = KFAC(mlp(), lr=0.1)
    # The output gradients are read by its reduction, in the hooks; no raw call is kept.
    assert [r.grad_outputs for r in optimizer.capture.reductions] == [True]
    assert not optimizer.capture.keep_calls and not optimizer.capture.grad_outputs
    with pytest.raises(ValueError, match="Invalid damping"):
        KFAC(mlp(), lr=0.1, damping=-1.0)
    with pytest.raises(ValueError, match="Invalid update_every"):
        KFAC(mlp(), lr=0.1, update_every=0)
    KFAC(mlp(), lr=0.1, grad_outputs=False)  # about raw calls, which K-FAC does not read


@pytest.mark.parametrize("rule", ["FOOF", "KFAC", "Eva"])
def test_zero_sums_are_shaped_as_the_hooks_sums(rule: str) -> None:
    """A data-parallel rank that captured no call of a layer joins the all-reduce with zero sums:
    the same shapes as the hooks compute, for plain, grouped and transposed layers."""
    from inputaware_optim import FOOF, Eva

    model = nn.Sequential(
        nn.Conv2d(4, 6, 3, groups=2),
        nn.ReLU(),
        nn.ConvTranspose2d(6, 4, 3, groups=2, bias=False),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
    ).double()
    optimizer = {"FOOF": FOOF, "KFAC": KFAC, "Eva": Eva}[rule](model, lr=0.1)
    nn.functional.mse_loss(model(torch.randn(2, 4, 6, 6, dtype=torch.float64)), torch.randn(2, 3).double()).backward()
    totals = optimizer.capture.reduced(optimizer.rules[0]._statistics)
    layers = optimizer.rules[0]._layers()
    assert len(layers) == 3
    for layer in layers:
        computed = totals[layer.module.weight]
        zeros = optimizer.rules[0]._zero_sums(layer)
        assert set(zeros) == set(computed)
        for factor, (numerator, denominator) in zeros.items():
            assert numerator.shape == computed[factor][0].shape, (layer.module, factor)
            assert isinstance(denominator, float) and isinstance(computed[factor][1], float), (layer.module, factor)
            assert numerator.dtype == computed[factor][0].dtype and not numerator.any()


class WithEmptyLayers(nn.Module):
    """Two preconditioned layers beside a layer with no outputs and one with no inputs (its bias only)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden, self.head = nn.Linear(6, 4), nn.Linear(4, 3)
        self.no_outputs, self.no_inputs = nn.Linear(6, 0), nn.Linear(0, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(torch.tanh(self.hidden(x))) + self.no_inputs(x[:, :0])
        return torch.cat([y, self.no_outputs(x)], dim=1)


@pytest.mark.parametrize("rule", ["FOOF", "KFAC", "Eva"])
def test_a_layer_of_width_zero_takes_the_stock_sgd_step(rule: str) -> None:
    """Linear(6, 0) and Linear(0, 3) (which torch.optim.SGD steps) take SGD's step, the other layers
    the rule's, as if the empty layers were not there."""
    import copy
    import warnings

    from inputaware_optim import FOOF, Eva

    cls = {"FOOF": FOOF, "KFAC": KFAC, "Eva": Eva}[rule]
    model = WithEmptyLayers().double()
    reference = copy.deepcopy(model)
    optimizer = cls(model, lr=0.1)
    ruled = [p for n, p in reference.named_parameters() if n.startswith(("hidden", "head"))]
    empty = [p for n, p in reference.named_parameters() if n.startswith("no_")]
    references = [cls(reference, lr=0.1, params=ruled), torch.optim.SGD(empty, lr=0.1, momentum=0.9)]
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, target = (torch.randn(5, n, generator=generator, dtype=torch.float64) for n in (6, 3))
        for m, optimizers in ((model, [optimizer]), (reference, references)):
            for o in optimizers:
                o.zero_grad()
            nn.functional.mse_loss(m(x), target).backward()
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # nothing to warn about: the stock step is the rule's here
                for o in optimizers:
                    o.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14, msg=name)
    assert not torch.equal(model.no_inputs.bias, WithEmptyLayers().double().no_inputs.bias)  # it did move
    torch.testing.assert_close(
        optimizer.state[model.no_inputs.bias]["momentum_buffer"],
        references[1].state[reference.no_inputs.bias]["momentum_buffer"],
    )


def kfac_pytorch_factors(
    module: nn.Module, inputs: torch.Tensor, grad_outputs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's A and G as kfac-pytorch's Linear and Conv2d helpers form them (written out from
    its source, in float64): rows with a 1 appended for the bias; a convolution's patch rows and
    output-gradient rows divided by the number of output positions L; both averaged over rows."""
    if isinstance(module, nn.Conv2d):
        positions = grad_outputs.shape[2] * grad_outputs.shape[3]
        rows = conv_patches(module, inputs)
        grads = grad_outputs.permute(0, 2, 3, 1).reshape(-1, grad_outputs.shape[1])
    else:
        positions = 1
        rows, grads = inputs.reshape(-1, inputs.shape[-1]), grad_outputs.reshape(-1, grad_outputs.shape[-1])
    if module.bias is not None:
        rows = with_ones(rows)
    rows, grads = rows / positions, grads / positions
    return rows.T @ rows / rows.shape[0], grads.T @ grads / grads.shape[0]


def kfac_pytorch_direction(
    grad: torch.Tensor, a: torch.Tensor, g: torch.Tensor, damping: float, method: str
) -> torch.Tensor:
    """kfac-pytorch's preconditioned gradient by a dense solve (row-major vec: (G ⊗ A) vec X = vec(G X A)):
    ``"inverse"`` damps each factor, ``"eigen"`` (its default) the Kronecker product."""
    eye_a, eye_g = torch.eye(len(a), dtype=a.dtype), torch.eye(len(g), dtype=g.dtype)
    if method == "inverse":
        matrix = torch.kron(g + damping * eye_g, a + damping * eye_a)
    else:
        matrix = torch.kron(g, a) + damping * torch.eye(len(a) * len(g), dtype=a.dtype)
    return torch.linalg.solve(matrix, grad.reshape(-1)).reshape(grad.shape)


class KeptInputAndGradient:
    """A forward hook keeping the module's input, then (by a tensor hook) the gradient at its output."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self.kept = [args[0].detach()]
        output.register_hook(self.kept.append)


@settings(max_examples=8, deadline=None)
@given(
    method=st.sampled_from(["inverse", "eigen"]),
    damping=st.floats(1e-3, 1.0),
    batch=st.integers(2, 6),
    decay=st.sampled_from([0.0, 0.5, 0.95]),
)
def test_the_kfac_pytorch_convention_reproduces_its_preconditioned_gradient(
    method: str, damping: float, batch: int, decay: float
) -> None:
    """Three steps on a Conv2d and a Linear layer, against kfac-pytorch's formulas in float64:
    factors scaled as there, running averages started from I, damping absolute (per factor for
    its compute_method="inverse", on the Kronecker product for "eigen", here inverse="eigh")."""
    model = Net().double()
    inverse = "cholesky" if method == "inverse" else "eigh"
    lr = 0.01
    optimizer = KFAC(
        model, lr=lr, momentum=0.0, damping=damping, stat_decay=decay, update_every=1,
        convention="kfac-pytorch", inverse=inverse,
    )  # fmt: skip
    layers = {"conv": model.conv, "fc": model.fc}
    running: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    generator = torch.Generator().manual_seed(batch)
    for _ in range(3):
        x = torch.randn(batch, 2, 4, 4, generator=generator, dtype=torch.float64)
        target = torch.randn(batch, 4, generator=generator, dtype=torch.float64)
        seen = {name: KeptInputAndGradient() for name in layers}  # each layer's input, then its output gradient
        handles = [m.register_forward_hook(seen[name]) for name, m in layers.items()]
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), target).backward()
        for handle in handles:
            handle.remove()
        expected = {}
        for name, module in layers.items():
            a, g = kfac_pytorch_factors(module, *seen[name].kept)
            old_a, old_g = running.get(name, (torch.eye(len(a), dtype=a.dtype), torch.eye(len(g), dtype=g.dtype)))
            running[name] = (decay * old_a + (1 - decay) * a, decay * old_g + (1 - decay) * g)
            grad = torch.cat([module.weight.grad.reshape(len(g), -1), module.bias.grad[:, None]], dim=1)
            expected[name] = kfac_pytorch_direction(grad, *running[name], damping, method)
        before = {name: torch.cat([m.weight.reshape(len(m.bias), -1), m.bias[:, None]], 1).detach().clone()
                  for name, m in layers.items()}  # fmt: skip
        optimizer.step()
        for name, module in layers.items():
            after = torch.cat([module.weight.reshape(len(module.bias), -1), module.bias[:, None]], 1).detach()
            torch.testing.assert_close((before[name] - after) / lr, expected[name], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(optimizer.rules[0].state[model.fc.weight]["input_second_moment"], running["fc"][0])
        torch.testing.assert_close(
            optimizer.rules[0].state[model.conv.weight]["output_grad_second_moment"], running["conv"][1]
        )


def test_convention_is_validated_by_name() -> None:
    with pytest.raises(ValueError, match=r"Invalid convention: 'kfac'"):
        KFAC(mlp(), lr=0.1, convention="kfac")


@pytest.mark.parametrize(
    ("layer", "named"),
    [
        (nn.Conv1d(2, 3, 3), r"1 \(Conv1d\)"),
        (nn.Conv2d(4, 4, 3, groups=2), r"1 \(Conv2d with groups=2\)"),
        (nn.ConvTranspose2d(2, 3, 3), r"1 \(ConvTranspose2d\)"),
        (nn.Conv3d(2, 3, 3), r"1 \(Conv3d\)"),
    ],
    ids=["Conv1d", "grouped Conv2d", "ConvTranspose2d", "Conv3d"],
)
def test_the_kfac_pytorch_convention_refuses_the_layers_kfac_pytorch_does_not_precondition(
    layer: nn.Module, named: str
) -> None:
    # They were accepted, with kfac-pytorch's per-position scaling applied where kfac-pytorch has none.
    refused = rf"KFAC\(convention='kfac-pytorch'\) cannot precondition {named}: kfac-pytorch preconditions nn\.Linear"
    model = nn.Sequential(nn.Linear(4, 4), layer)
    with pytest.raises(ValueError, match=refused):
        KFAC(model, lr=0.1, convention="kfac-pytorch")
    KFAC(model, lr=0.1)  # the default convention covers it
    optimizer = KFAC(model, lr=0.1, convention="kfac-pytorch", params=list(model[0].parameters()))
    with pytest.raises(ValueError, match=refused):
        optimizer.add_param_group({"params": list(model[1].parameters())})
    assert len(optimizer.param_groups) == 1 and optimizer.capture.modules == (model[0],)  # nothing changed


def test_under_the_kfac_pytorch_convention_hugging_faces_conv1d_is_the_linear_it_equals() -> None:
    """kfac-pytorch knows nn.Linear and nn.Conv2d by type; a Conv1D (GPT-2's Linear, its weight stored
    transposed) takes nn.Linear's convention here, step for step."""
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    torch.manual_seed(0)
    linear, transposed = nn.Linear(4, 3).double(), conv1d(3, 4).double()
    with torch.no_grad():
        transposed.weight.copy_(linear.weight.T)
        transposed.bias.copy_(linear.bias)
    optimizers = [KFAC(m, lr=0.1, convention="kfac-pytorch", update_every=1) for m in (linear, transposed)]
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 4, generator=generator, dtype=torch.float64)
        for module, optimizer in zip((linear, transposed), optimizers, strict=True):
            optimizer.zero_grad()
            module(x).pow(2).sum().backward()
            optimizer.step()
        torch.testing.assert_close(transposed.weight, linear.weight.T, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(transposed.bias, linear.bias, rtol=1e-12, atol=1e-14)


@settings(max_examples=20, deadline=None)
@given(
    damping=st.floats(1e-4, 10.0),
    input_scale=st.floats(1e-2, 1e2),
    loss_scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_each_factor_is_damped_by_the_same_fraction_of_its_mean_eigenvalue(
    damping: float, input_scale: float, loss_scale: float, seed: int
) -> None:
    """Whatever the scale of the inputs and of the loss, the damping added to A and to G, recovered
    from the kept inverses, is the same fraction √(λ / (m_A m_G)) of each factor's mean eigenvalue
    (it was √λ for both: at a small m_G, G's own curvature was swamped)."""
    model = mlp(seed % 7)
    optimizer = KFAC(model, lr=0.1, damping=damping)
    x = input_scale * torch.randn(5, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    (loss_scale * model(x).pow(2).sum(dim=1).mean()).backward()
    optimizer.step()
    for layer in (model[0], model[2]):
        state = optimizer.rules[0].state[layer.weight]
        added, means = {}, {}
        for factor in ("input", "output_grad"):
            moment = state[f"{factor}_second_moment"]
            shift = torch.linalg.inv(state[f"{factor}_inverse"]) - moment
            added[factor] = shift.diagonal().mean()
            means[factor] = torch.linalg.eigvalsh(moment).mean()
            torch.testing.assert_close(
                shift,
                added[factor] * torch.eye(len(moment), dtype=torch.float64),
                rtol=0,
                atol=1e-6 * float(added[factor]) + 1e-9 * float(moment.abs().max()),
            )
        fraction = math.sqrt(damping / float(means["input"] * means["output_grad"]))
        for factor in added:
            assert float(added[factor] / means[factor]) == pytest.approx(fraction, rel=1e-6)
