"""The issue-44 candidates (benchmarks/candidates.py) against dense float64 references of their formulas.

The shipped one, ``inputaware_optim.WhitenedMuon``, is tested in tests/test_whitened_muon.py against the same
reference (``Reference("whitened_muon")``, below).

Each reference below is the candidate's formula written out with ``torch.linalg`` (``eigh`` for the inverse roots
and eigenbases, the SVD's ``U Vᵀ`` for the exact polar factor) on the layer's input rows, output-gradient rows and
gradient, taken with hooks on a twin model; the candidate's Newton–Schulz is checked against the reference with
the same Newton–Schulz (``benchmarks.baselines.newton_schulz``) and its ``polar="svd"`` against the exact polar.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from benchmarks.baselines import newton_schulz
from benchmarks.candidates import EigenbasisAdam, TwoSidedMuon
from inputaware_optim import CoverageWarning, InputAwareOptimizer, InputAwareSGD, Rule

_MUON = inspect.signature(torch.optim.Muon).parameters
MUON_COEFFICIENTS, MUON_STEPS, MUON_EPS = (_MUON[k].default for k in ("ns_coefficients", "ns_steps", "eps"))


# -- the references ---------------------------------------------------------------------------------------------


def exact_polar(matrix: Tensor) -> Tensor:
    u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    return u @ vh


def muon_polar(matrix: Tensor) -> Tensor:
    return newton_schulz(matrix, MUON_COEFFICIENTS, MUON_STEPS, MUON_EPS)


def inverse_root(matrix: Tensor, damping: float | Tensor) -> Tensor:
    """``(M + damping I)^(-1/2)`` of a second moment (its eigenvalues below 0, rounding, as 0)."""
    values, vectors = torch.linalg.eigh(matrix)
    return vectors @ torch.diag((values.clamp_min(0) + damping).rsqrt()) @ vectors.T


def mean_eigenvalue(matrix: Tensor) -> Tensor:
    return torch.trace(matrix) / matrix.shape[0]


def whitened_roots(a: Tensor, b: Tensor | None, damping: float) -> tuple[Tensor | None, Tensor]:
    """WhitenedMuon's ``A_λ^(-1/2)`` (``b`` None), or TwoSidedMuon's ``(B̂_λ^(-1/2), A_λ^(-1/2))``: ``B̂ = B / m_B``
    and K-FAC's factored damping ``π√λ``, ``√λ/π`` with ``π = sqrt(m_A / m_B̂)``."""
    if b is None:
        return None, inverse_root(a, damping)
    b_hat = b / mean_eigenvalue(b)
    pi = (mean_eigenvalue(a) / mean_eigenvalue(b_hat)).sqrt()
    return inverse_root(b_hat, math.sqrt(damping) / pi), inverse_root(a, pi * math.sqrt(damping))


def polar_direction(momentum: Tensor, roots: tuple[Tensor | None, Tensor], polar: Callable[[Tensor], Tensor]) -> Tensor:
    """``0.2 sqrt(max(m, n)) polar(U R) R``, or two-sided ``L polar(L U R) R``."""
    left, right = roots
    scale = 0.2 * math.sqrt(max(momentum.shape))
    if left is None:
        return scale * polar(momentum @ right) @ right
    return scale * left @ polar(left @ momentum @ right) @ right


class LayerData:
    """A ``Linear``'s input rows ``x̃`` (ones appended with a bias), output-gradient rows and gradient ``G̃``."""

    def __init__(self, rows: Tensor, grads: Tensor, matrix: Tensor) -> None:
        self.rows, self.grads, self.matrix = rows, grads, matrix
        self.a = rows.T @ rows / rows.shape[0]
        self.b = grads.T @ grads / grads.shape[0]


def loss_of(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return 0.5 * (model(x) - y).pow(2).sum(-1).mean()


def layer_data(model: nn.Module, x: Tensor, y: Tensor) -> dict[nn.Linear, LayerData]:
    """Backpropagate ``loss_of`` through ``model`` with hooks on its ``Linear`` layers (gradients left in place)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    seen: dict[nn.Module, tuple[Tensor, Tensor]] = {}

    def keep(module: nn.Module, args: Any, output: Tensor) -> None:
        output.retain_grad()
        seen[module] = (args[0].detach(), output)

    handles = [m.register_forward_hook(keep) for m in linears]
    model.zero_grad()
    loss_of(model, x, y).backward()
    for handle in handles:
        handle.remove()
    out = {}
    for m in linears:
        inputs, output = seen[m]
        rows = inputs.reshape(-1, m.in_features)
        matrix = m.weight.grad
        if m.bias is not None:
            rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], dim=1)
            matrix = torch.cat([matrix, m.bias.grad[:, None]], dim=1)
        assert output.grad is not None
        out[m] = LayerData(rows, output.grad.reshape(-1, m.out_features), matrix.clone())
    return out


def apply_sgd(layer: nn.Linear, direction: Tensor, lr: float, weight_decay: float) -> None:
    """SGD without momentum, coupled weight decay: ``p ← p − lr (d + wd p)``."""
    with torch.no_grad():
        n = layer.in_features
        layer.weight -= lr * (direction[:, :n] + weight_decay * layer.weight)
        if layer.bias is not None:
            layer.bias -= lr * (direction[:, n] + weight_decay * layer.bias)


class Reference:
    """A candidate's formula over several steps, in float64: running moments on the statistics steps, the transform
    refreshed at the first statistics step ``update_every`` steps after the last, then SGD's step."""

    def __init__(self, rule: str, polar: Callable[[Tensor], Tensor] = exact_polar, **options: Any) -> None:
        self.rule, self.polar = rule, polar
        self.options = {
            "damping": 0.1,
            "stat_decay": 0.95,
            "update_every": 10,
            "statistics_every": 1,
            "lr": 0.1,
            "weight_decay": 0.0,
            "momentum": 0.95,
            "nesterov": True,
            "betas": (0.9, 0.999),
            "eps": 1e-8,
            **options,
        }
        self.state: dict[nn.Module, dict[str, Any]] = {}
        self.steps = 0

    def step(self, model: nn.Module, x: Tensor, y: Tensor) -> None:
        o = self.options
        for layer, data in layer_data(model, x, y).items():
            state = self.state.setdefault(layer, {})
            if self.steps % o["statistics_every"] == 0:
                for key, new in (("a", data.a), ("b", data.b)):
                    state[key] = new if key not in state else o["stat_decay"] * state[key] + (1 - o["stat_decay"]) * new
                if "refreshed" not in state or self.steps - state["refreshed"] >= o["update_every"]:
                    self.refresh(state)
                    state["refreshed"] = self.steps
            apply_sgd(layer, self.direction(state, data.matrix), o["lr"], o["weight_decay"])
        self.steps += 1

    def refresh(self, state: dict[str, Any]) -> None:
        if self.rule == "eigenbasis_adam":
            if "q_a" in state:
                state["previous"] = (state["q_a"], state["q_b"])
            state["q_a"], state["q_b"] = torch.linalg.eigh(state["a"])[1], torch.linalg.eigh(state["b"])[1]
        else:
            b = state["b"] if self.rule == "two_sided_muon" else None
            state["roots"] = whitened_roots(state["a"], b, self.options["damping"])

    def direction(self, state: dict[str, Any], matrix: Tensor) -> Tensor:
        o = self.options
        if self.rule != "eigenbasis_adam":  # Muon's (Nesterov) momentum of the raw gradient, then the polar step
            mu = o["momentum"]
            buffer = state["buffer"] = mu * state.get("buffer", torch.zeros_like(matrix)) + (1 - mu) * matrix
            direction = (1 - mu) * matrix + mu * buffer if o["nesterov"] else buffer
            return polar_direction(direction, state["roots"], self.polar)
        (beta1, beta2), q_a, q_b = o["betas"], state["q_a"], state["q_b"]
        # SOAP's form: the first moment in the original coordinates, the second in the eigenbasis
        state["m"] = beta1 * state.get("m", torch.zeros_like(matrix)) + (1 - beta1) * matrix
        rotated = q_b.T @ matrix @ q_a
        state["v"] = beta2 * state.get("v", torch.zeros_like(rotated)) + (1 - beta2) * rotated**2
        t = state["t"] = state.get("t", 0) + 1
        adam = (q_b.T @ state["m"] @ q_a / (1 - beta1**t)) / ((state["v"] / (1 - beta2**t)).sqrt() + o["eps"])
        return q_b @ adam @ q_a.T


RULES: dict[str, Callable[..., Rule]] = {
    "two_sided_muon": TwoSidedMuon,
    "eigenbasis_adam": EigenbasisAdam,
}


def candidate(rule: str, polar: str = "svd", **options: Any) -> Rule:
    if rule == "eigenbasis_adam":
        options.pop("damping", None)
        return EigenbasisAdam(**options)
    return RULES[rule](polar=polar, **options)


def optimizer_for(model: nn.Module, rule: Rule, lr: float = 0.1, weight_decay: float = 0.0) -> InputAwareOptimizer:
    return InputAwareOptimizer(model, rules=[rule], base=torch.optim.SGD, lr=lr, weight_decay=weight_decay)


def data(generator: torch.Generator, rows: int, inputs: int, outputs: int) -> tuple[Tensor, Tensor]:
    x = torch.randn(rows, inputs, generator=generator, dtype=torch.float64) * torch.linspace(0.5, 2.0, inputs).double()
    return x + 0.3, torch.randn(rows, outputs, generator=generator, dtype=torch.float64)


# -- one step against the formula ---------------------------------------------------------------------------------


@settings(max_examples=12)
@given(
    rule=st.sampled_from(sorted(RULES)),
    inputs=st.integers(1, 6),
    outputs=st.integers(1, 6),
    bias=st.booleans(),
    damping=st.sampled_from([1e-3, 1e-2, 0.1, 1.0]),
    exact=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_one_step_is_the_formula(
    rule: str, inputs: int, outputs: int, bias: bool, damping: float, exact: bool, seed: int
) -> None:
    """On a random ``Linear``: the SGD step on the candidate's gradient is its dense float64 formula (the exact polar
    factor with ``polar="svd"``, Muon's Newton–Schulz on the reference's own matrix otherwise)."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layer = nn.Linear(inputs, outputs, bias=bias).double()
    twin = copy.deepcopy(layer)
    x, y = data(generator, 3 * (inputs + outputs) + 4, inputs, outputs)
    optimizer = optimizer_for(layer, candidate(rule, "svd" if exact else "newton-schulz", damping=damping))
    optimizer.zero_grad()
    loss_of(layer, x, y).backward()
    optimizer.step()
    reference = Reference(rule, exact_polar if exact else muon_polar, damping=damping)
    reference.step(twin, x, y)
    torch.testing.assert_close(layer.weight, twin.weight, rtol=1e-7, atol=1e-9)
    if bias:
        torch.testing.assert_close(layer.bias, twin.bias, rtol=1e-7, atol=1e-9)


# -- several steps: the moments, the schedule, the momentum ------------------------------------------------------


@pytest.mark.parametrize("rule", sorted(RULES))
def test_several_steps_with_refreshes_are_the_formula(rule: str) -> None:
    """Seven steps on a two-layer model, statistics every 2 steps and refreshes at least 3 steps apart (at steps 0
    and 4: the eigenbases change mid-run, and the Adam moments carry over), with weight decay: each layer's weights
    match the float64 reference after every step."""
    options = {"damping": 0.05, "stat_decay": 0.8, "update_every": 3, "statistics_every": 2}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    twin = copy.deepcopy(model)
    rule_instance = candidate(rule, **options)
    optimizer = optimizer_for(model, rule_instance, lr=0.05, weight_decay=0.01)
    reference = Reference(rule, lr=0.05, weight_decay=0.01, **options)
    generator = torch.Generator().manual_seed(3)
    transforms = []
    for _ in range(7):
        x, y = data(generator, 24, 5, 3)
        optimizer.zero_grad()
        loss_of(model, x, y).backward()
        optimizer.step()
        reference.step(twin, x, y)
        for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-7, atol=1e-9)
        key = "input_eigenvectors" if rule == "eigenbasis_adam" else "input_inverse_root"
        transforms.append(rule_instance.state[model[0].weight][key])
    state = rule_instance.state[model[2].weight]
    assert state["statistics_steps"] == 4 and state["refresh_step"] == 4  # statistics at 0, 2, 4, 6; refreshed at 0, 4
    assert transforms[0] is transforms[3] and transforms[3] is not transforms[4]


# -- state, refusals, coverage ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", sorted(RULES))
def test_state_dict_round_trip_resumes_bitwise(rule: str) -> None:
    """Three steps, a state dict into a fresh optimizer on a copy of the model (and a deepcopy of both), three more
    steps on each: the same bits (the schedule's step count travels: the resumed run is at a step between
    statistics)."""
    options = {"update_every": 3, "statistics_every": 2}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    optimizer = optimizer_for(model, candidate(rule, "newton-schulz", **options), lr=0.02, weight_decay=0.01)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 5, generator=generator), torch.randn(16, 3, generator=generator)) for _ in range(6)]

    def train(m: nn.Module, o: torch.optim.Optimizer, steps: list[tuple[Tensor, Tensor]]) -> None:
        for x, y in steps:
            o.zero_grad()
            loss_of(m, x, y).backward()
            o.step()

    train(model, optimizer, batches[:3])
    resumed_model = copy.deepcopy(model)
    resumed = optimizer_for(resumed_model, candidate(rule, "newton-schulz", **options), lr=0.02, weight_decay=0.01)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    copied_model, copied = copy.deepcopy((model, optimizer))  # (the rule rebuilt from its arguments, then loaded)
    for m, o in ((model, optimizer), (resumed_model, resumed), (copied_model, copied)):
        train(m, o, batches[3:])
    for ours, resumed_param, copied_param in zip(
        model.parameters(), resumed_model.parameters(), copied_model.parameters(), strict=True
    ):
        assert torch.equal(ours, resumed_param) and torch.equal(ours, copied_param)


def _snapshot(model: nn.Module, optimizer: InputAwareOptimizer) -> Any:
    state = {k: v.clone() if isinstance(v, Tensor) else v for k, v in optimizer.rules[0].state[model[0].weight].items()}
    return [p.detach().clone() for p in model.parameters()], [p.grad.clone() for p in model.parameters()], state


@pytest.mark.parametrize("rule", ["two_sided_muon"])
def test_an_ill_conditioned_factor_is_refused_by_name_changing_nothing(rule: str) -> None:
    """Inputs of rank 2 with damping set to 0 since the last step: the refreshed factor's condition number is infinite
    (over ``condition_limit``), so the step is refused naming the layer and the damping, and no parameter, gradient
    or state moves."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4))
    optimizer = optimizer_for(model, candidate(rule, "newton-schulz", damping=0.01, stat_decay=0.0, update_every=1))
    x, y = torch.randn(32, 5), torch.randn(32, 4)
    loss_of(model, x, y).backward()
    optimizer.step()
    optimizer.param_groups[0]["damping"] = 0.0
    optimizer.zero_grad()
    loss_of(model, torch.randn(2, 5).repeat(16, 1), y).backward()
    before = _snapshot(model, optimizer)
    with pytest.raises(RuntimeError, match=r"damped statistics of 0 \(.*\) are not positive definite \(damping=0\)"):
        optimizer.step()
    after = _snapshot(model, optimizer)
    for old, new in zip(before[0] + before[1], after[0] + after[1], strict=True):
        assert torch.equal(old, new)
    assert before[2].keys() == after[2].keys()
    assert all(torch.equal(before[2][k], after[2][k]) for k in before[2] if isinstance(before[2][k], Tensor))


def test_eigenbasis_adam_inverts_nothing_and_refuses_only_statistics_that_are_not_finite() -> None:
    """No inverse, no condition: a rank-2 input factor is a basis like any other; an infinite input is refused by name
    before any change."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4))
    optimizer = optimizer_for(model, EigenbasisAdam(update_every=1))
    loss_of(model, torch.randn(2, 5).repeat(16, 1), torch.randn(32, 4)).backward()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    optimizer.zero_grad()
    x = torch.randn(32, 5)
    x[3, 1] = math.inf
    loss_of(model, x, torch.randn(32, 4)).backward()
    before = _snapshot(model, optimizer)
    with pytest.raises(RuntimeError, match=r"statistics of 0 \(input\) are not finite"):
        optimizer.step()
    after = _snapshot(model, optimizer)
    for old, new in zip(before[0] + before[1], after[0] + after[1], strict=True):
        torch.testing.assert_close(old, new, rtol=0, atol=0, equal_nan=True)  # (the gradient holds NaN)
    assert all(torch.equal(before[2][k], after[2][k]) for k in before[2] if isinstance(before[2][k], Tensor))


@pytest.mark.parametrize("rule", sorted(RULES))
def test_layers_without_input_rows_take_the_base_update_and_are_reported(rule: str) -> None:
    """An embedding and a norm: their gradients reach SGD as backward left them; ``coverage()`` names the
    embedding's weight matrix as a fallback (warned at the first step) and the norm's scale as stock by design."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    optimizer = optimizer_for(model, candidate(rule, "newton-schulz"), lr=0.1)
    rows = {row.name: row for row in optimizer.coverage()}
    assert rows["0.weight"].fallback and rows["0.weight"].treatment == "stock SGD" and rows["0.weight"].reason
    assert not rows["1.weight"].fallback and rows["1.weight"].treatment == "stock SGD"
    assert rows["2.weight"].treatment.startswith(type(optimizer.rules[0]).__name__)
    assert rows["2.bias"].treatment.startswith(type(optimizer.rules[0]).__name__)
    tokens = torch.randint(0, 10, (8, 5))
    loss_of(model, tokens, torch.randn(8, 5, 3)).backward()
    stock = [(p.detach().clone(), p.grad.clone()) for p in (model[0].weight, model[1].weight, model[1].bias)]
    with pytest.warns(CoverageWarning, match="0.weight"):
        optimizer.step()
    for (before, grad), param in zip(stock, (model[0].weight, model[1].weight, model[1].bias), strict=True):
        torch.testing.assert_close(param.detach(), before - 0.1 * grad, rtol=0, atol=0)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_base_with_momentum_is_refused(rule: str) -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(ValueError, match=r"momentum of 0\.9 would apply momentum a second time"):
        InputAwareSGD(model, rules=[candidate(rule)], lr=0.1, momentum=0.9)
    InputAwareSGD(model, rules=[candidate(rule)], lr=0.1)  # (the drop-in's default: no momentum)


def test_hyperparameters_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match="Invalid damping: -1"):
        TwoSidedMuon(-1.0)
    with pytest.raises(ValueError, match=r"Invalid muon_momentum: 1\.0"):
        TwoSidedMuon(muon_momentum=1.0)
    with pytest.raises(ValueError, match="Invalid polar: 'qr'"):
        TwoSidedMuon(polar="qr")
    with pytest.raises(ValueError, match="Invalid adam_betas"):
        EigenbasisAdam(adam_betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="Invalid statistics_every: 0"):
        EigenbasisAdam(statistics_every=0)
    with pytest.raises(ValueError, match="Invalid inverse_dtype"):
        EigenbasisAdam(inverse_dtype=torch.float16)


# -- the benchmark's factories ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["whitened_muon", "two_sided_muon", "eigenbasis_adam"])
def test_factories_split_the_model_as_documented_and_train(name: str) -> None:
    """(a), (b): the Muon recipe's hidden matrices, AdamW the rest; (c): every layer with both Kronecker factors
    (biases folded in), AdamW the rest. The candidate's part is SGD without momentum with the recipe's weight decay."""
    pytest.importorskip("sklearn")  # benchmarks.rules imports benchmarks.digits (the bench extra)
    from benchmarks import baselines, rules
    from benchmarks.models import autoencoder

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 12), autoencoder((12, 10, 6, 10, 12)))
    combined = getattr(rules, name)()(model, 1e-2)
    part, adamw = combined.parts
    assert isinstance(part, InputAwareOptimizer) and type(adamw) is torch.optim.AdamW
    shipped = {"whitened_muon": "WhitenedMuonPreconditioner"}  # (the library's; the others are candidates)
    assert type(part.rules[0]).__name__ == shipped.get(name, "".join(word.title() for word in name.split("_")))
    group = part.param_groups[0]
    assert group["momentum"] == 0 and group["weight_decay"] == baselines.WEIGHT_DECAY
    assert group["statistics_every"] == rules.STATISTICS_EVERY and group["update_every"] == rules.UPDATE_EVERY
    covered = [p for g in part.param_groups for p in g["params"]]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if name == "eigenbasis_adam":
        assert covered == [p for m in linears for p in (m.weight, m.bias)]
    else:
        assert covered == baselines.hidden_matrices(model)
    x = torch.randint(0, 16, (32,))
    losses = []
    for _ in range(3):
        combined.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        combined.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


@pytest.mark.parametrize("name", ["whitened_muon", "two_sided_muon", "eigenbasis_adam"])
def test_candidate_floors_do_the_candidates_arithmetic(name: str) -> None:
    """``rules.candidate_floor``'s first step on each layer it holds is the candidate's formula on the floor's own
    (random) statistics rows: its time is the candidate's arithmetic, not some other."""
    pytest.importorskip("sklearn")  # benchmarks.rules imports benchmarks.digits (the bench extra)
    from benchmarks import baselines, rules
    from benchmarks.models import autoencoder

    torch.manual_seed(0)
    model = autoencoder((12, 10, 6, 10, 12))
    combined = rules.candidate_floor(name)(model, 0.01)
    floor = combined.parts[0]
    model(torch.rand(32, 12)).square().mean().backward()
    layers = floor._floor_layers
    assert len(layers) == (4 if name == "eigenbasis_adam" else 2)
    before = [(layer.weight.detach().clone(), layer.weight.grad.clone()) for layer in layers]
    biases = [None if layer.bias is None else layer.bias.grad.clone() for layer in layers]
    combined.step()
    mu = 0.95
    for layer, (weight, grad), bias in zip(layers, before, biases, strict=True):
        matrix = (grad if bias is None else torch.cat([grad, bias[:, None]], dim=1)).double()
        a, b = ((rows.T @ rows / rows.shape[0]).double() for rows in (layer.rows[0], layer.rows[-1]))
        if name == "eigenbasis_adam":
            q_a, q_b = torch.linalg.eigh(a)[1], torch.linalg.eigh(b)[1]
            rotated = q_b.T @ matrix @ q_a
            direction = q_b @ (rotated / (rotated.abs() + 1e-8)) @ q_a.T  # Adam's first step, bias-corrected
        else:
            roots = whitened_roots(a, b if name == "two_sided_muon" else None, rules.CANDIDATE_DAMPING)
            direction = polar_direction((1 - mu * mu) * matrix, roots, muon_polar)  # Nesterov's first step
        expected = weight.double() - 0.01 * (direction[:, : weight.shape[1]] + baselines.WEIGHT_DECAY * weight.double())
        torch.testing.assert_close(layer.weight.detach().double(), expected, rtol=1e-4, atol=1e-6)
