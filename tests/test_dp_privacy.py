"""DP-SGD where a privacy review looks: hyperparameters changed mid-run, layers frozen mid-run, the
accounting over a changing noise, empty batches, reentrant checkpointing, errors, mixed precision.

Every expected gradient comes from ``torch.func.vmap(grad)`` in float64 (clipped and averaged the
textbook way), from the same noise stream drawn by hand, or from Opacus."""

from __future__ import annotations

import copy
import math
import pickle
import traceback
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.checkpoint import checkpoint

from inputaware_optim import DPSGD, DPAdamW


class Chain(nn.Module):
    """Three linear layers: each one's output gradient depends on the ones after it."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.first, self.middle, self.head = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.middle(torch.tanh(self.first(x)))))


def loss_of(output: torch.Tensor) -> torch.Tensor:
    """Each sample's loss ``|output_i|²``, averaged over the batch."""
    return output.pow(2).flatten(1).sum(1).mean()


def reference(model: nn.Module, x: torch.Tensor, clip: float) -> dict[str, torch.Tensor]:
    """The noise-free DP-SGD gradient of ``loss_of`` over the parameters that require grad (the others
    are constants): per-sample gradients by vmap(grad), clipped jointly, averaged."""
    trained = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}

    def loss_of_one(params: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
        return functional_call(model, {**params, **frozen}, (xi[None],)).pow(2).sum()

    per_sample = vmap(grad(loss_of_one), in_dims=(None, 0))(trained, x)
    norms = torch.sqrt(sum(g.reshape(len(x), -1).pow(2).sum(1) for g in per_sample.values()))
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    return {k: torch.tensordot(factors, g, dims=1) / len(x) for k, g in per_sample.items()}


def batch(size: int, seed: int, features: int = 5) -> torch.Tensor:
    return torch.randn(size, features, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def assert_grads(model: nn.Module, expected: dict[str, torch.Tensor], **tolerance: Any) -> None:
    tolerance = tolerance or {"rtol": 1e-9, "atol": 1e-12}
    for key, value in expected.items():
        torch.testing.assert_close(model.get_parameter(key).grad, value, msg=key, **tolerance)


# -- 1. hyperparameters read at the step -------------------------------------------------------


@given(clips=st.lists(st.sampled_from([1e-3, 0.02, 0.3, 5.0]), min_size=2, max_size=3))
def test_a_clip_schedule_clips_at_the_value_of_each_step(clips: list[float]) -> None:
    """``max_grad_norm`` changed in the param group between steps (a clip schedule): each step clips
    at the value the group holds then, not the one given at construction."""
    model = Chain().double()
    optimizer = DPSGD(model, lr=0.5, max_grad_norm=1.0, noise_multiplier=0.0)
    for step, clip in enumerate(clips):
        optimizer.param_groups[0]["max_grad_norm"] = clip
        x = batch(6, seed=step)
        expected = reference(model, x, clip)
        optimizer.zero_grad()
        loss_of(model(x)).backward()
        optimizer.step()
        assert_grads(model, expected)


def test_a_noise_schedule_draws_at_the_values_of_the_step() -> None:
    """The noise's standard deviation is ``sigma * C / B`` with both read from the group at the step:
    the private gradient is the clipped mean plus the generator's draws times that."""
    model = Chain().double()
    optimizer = DPSGD(
        model, lr=0.1, max_grad_norm=1.0, noise_multiplier=1.0, generator=torch.Generator().manual_seed(3)
    )
    stream = torch.Generator().manual_seed(3)
    for step, (clip, sigma) in enumerate([(1.0, 1.0), (0.05, 3.0)]):
        optimizer.param_groups[0].update(max_grad_norm=clip, noise_multiplier=sigma)
        x = batch(4, seed=10 + step)
        expected = reference(model, x, clip)
        optimizer.zero_grad()
        loss_of(model(x)).backward()
        optimizer.step()
        for key, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=stream) * (sigma * clip / len(x))
            torch.testing.assert_close(param.grad, expected[key] + noise.double(), rtol=1e-7, atol=1e-9, msg=key)


def test_a_clip_changed_between_backward_and_step_is_refused() -> None:
    """The samples are clipped when their backward pass ends: a clip set after that cannot apply to
    them, and drawing the noise at it would be wrong, so the step refuses and changes nothing."""
    model = Chain().double()
    optimizer = DPSGD(model, lr=0.5, max_grad_norm=1.0, noise_multiplier=0.0)
    loss_of(model(batch(4, seed=1))).backward()
    optimizer.param_groups[0]["max_grad_norm"] = 0.01
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        RuntimeError, match=r"max_grad_norm is 0.01 now, but the samples of this step were clipped at 1.0"
    ):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_a_batch_schedule_is_read_at_each_step_and_accounted_at_its_rate() -> None:
    """``expected_batch_size`` and ``sample_rate`` are param-group keys, read when the step runs (a batch-size
    schedule sets both): the noised sum is divided by the step's, and ``privacy_history`` records each step at
    its own rate. One changed between a backward and its step is refused, as the clip is."""
    model = Chain().double()
    optimizer = DPSGD(
        model,
        lr=0.1,
        max_grad_norm=0.5,
        noise_multiplier=1.0,
        expected_batch_size=4,
        sample_rate=0.01,
        generator=torch.Generator().manual_seed(3),
    )
    stream = torch.Generator().manual_seed(3)
    for step, (size, rate) in enumerate([(4, 0.01), (8, 0.02), (8, 0.02)]):
        optimizer.param_groups[0].update(expected_batch_size=size, sample_rate=rate)
        x = batch(size, seed=20 + step)
        expected = reference(model, x, 0.5)
        optimizer.zero_grad()
        loss_of(model(x)).backward()
        optimizer.step()
        for key, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=stream) * (1.0 * 0.5 / size)
            torch.testing.assert_close(param.grad, expected[key] + noise.double(), rtol=1e-7, atol=1e-9, msg=key)
    assert optimizer.privacy_history == [(1.0, 0.01, 1), (1.0, 0.02, 2)]
    optimizer.zero_grad()
    loss_of(model(batch(8, seed=30))).backward()
    optimizer.param_groups[0]["expected_batch_size"] = 16
    with pytest.raises(
        RuntimeError, match=r"expected_batch_size is 16 now, but the samples of this step were scaled by 8"
    ):
        optimizer.step()
    with pytest.raises(ValueError, match=r"Invalid sample_rate: 2.0"):
        optimizer.param_groups[0].update(expected_batch_size=8, sample_rate=2.0)
        optimizer.step()


def test_a_state_dict_from_before_the_batch_keys_loads_with_the_constructors() -> None:
    model = Chain().double()
    optimizer = DPSGD(model, lr=0.1, expected_batch_size=4, sample_rate=0.01)
    state = optimizer.state_dict()
    for group in state["param_groups"]:
        del group["expected_batch_size"], group["sample_rate"]
    again = DPSGD(model, lr=0.1, expected_batch_size=4, sample_rate=0.01)
    again.load_state_dict(state)
    assert again.param_groups[0]["expected_batch_size"] == 4 and again.param_groups[0]["sample_rate"] == 0.01


def test_param_groups_that_disagree_at_the_step_are_refused_by_name() -> None:
    model = Chain().double()
    groups = [{"params": model.first.parameters()}, {"params": [*model.middle.parameters(), *model.head.parameters()]}]
    optimizer = DPSGD(model, lr=0.5, max_grad_norm=1.0, noise_multiplier=0.5, params=groups)
    optimizer.param_groups[1]["noise_multiplier"] = 2.0
    loss_of(model(batch(4, seed=1))).backward()
    with pytest.raises(ValueError, match=r"group 0 has noise_multiplier=0.5, param group 1 noise_multiplier=2.0"):
        optimizer.step()
    optimizer.param_groups[1]["noise_multiplier"] = 0.5
    optimizer.param_groups[0]["sample_rate"] = 0.01
    with pytest.raises(ValueError, match=r"group 0 has sample_rate=0.01, param group 1 sample_rate=None"):
        optimizer.step()


# -- 4. layers frozen after construction -------------------------------------------------------


@pytest.mark.parametrize("frozen", ["first", "middle", "head", "middle.weight"])
def test_a_layer_frozen_after_construction_leaves_every_sample_norm(frozen: str) -> None:
    """``requires_grad_(False)`` after construction (fine-tuning): the frozen tensors are constants
    of the loss, so they enter no sample's norm; unfrozen again, they do again."""
    model = Chain().double()
    optimizer = DPSGD(model, lr=0.5, max_grad_norm=0.05, noise_multiplier=0.0)
    part = model.get_submodule(frozen) if "." not in frozen else model.get_parameter(frozen)
    for step, requires_grad in enumerate([False, True]):
        part.requires_grad_(requires_grad)
        x = batch(6, seed=20 + step)
        expected = reference(model, x, 0.05)
        optimizer.zero_grad()
        loss_of(model(x)).backward()
        optimizer.step()
        assert_grads(model, expected)
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


# -- 2. epsilon over a changing noise ----------------------------------------------------------


def private_steps(optimizer: DPSGD, model: nn.Module, sigmas: list[float], seed: int = 0) -> None:
    """One step per entry of ``sigmas``, each at that noise multiplier (set in the group before it)."""
    for step, sigma in enumerate(sigmas):
        optimizer.param_groups[0]["noise_multiplier"] = sigma
        optimizer.zero_grad()
        loss_of(model(batch(4, seed=seed + step))).backward()
        optimizer.step()


def opacus_epsilon(sigmas: list[float], sample_rate: float, delta: float, mechanism: str) -> float:
    """Opacus's own accountant, stepped once per step as its DPOptimizer does."""
    from opacus.accountants import create_accountant

    accountant = create_accountant(mechanism=mechanism)
    for sigma in sigmas:
        accountant.step(noise_multiplier=sigma, sample_rate=sample_rate)
    return float(accountant.get_epsilon(delta=delta))


@settings(max_examples=10)
@given(
    phases=st.lists(st.tuples(st.sampled_from([0.6, 1.1, 4.0]), st.integers(1, 4)), min_size=1, max_size=3),
    sample_rate=st.sampled_from([0.01, 0.2]),
)
def test_epsilon_composes_every_step_at_its_own_noise(phases: list[tuple[float, int]], sample_rate: float) -> None:
    """Opacus's RDP accountant stepped at each step's noise multiplier is the reference."""
    sigmas = [sigma for sigma, steps in phases for _ in range(steps)]
    model = nn.Linear(5, 2).double()
    optimizer = DPSGD(model, lr=0.1, max_grad_norm=1.0, noise_multiplier=1.0, sample_rate=sample_rate)
    private_steps(optimizer, model, sigmas)
    expected = opacus_epsilon(sigmas, sample_rate, 1e-5, "rdp")
    assert optimizer.epsilon(1e-5, accountant="rdp") == pytest.approx(expected, rel=1e-12)


TARGETS = [  # (optimizer, epsilon, delta, sample_rate, steps or epochs, accountant)
    (DPSGD, 1.0, 1e-5, 0.01, {"epochs": 1}, "rdp"),
    (DPAdamW, 8.0, 1e-6, 0.004, {"steps": 300}, "rdp"),
    (DPSGD, 1.0, 1e-6, 0.25, {"epochs": 2}, "prv"),
    (DPAdamW, 3.0, 1e-5, 0.1, {"steps": 50}, "gdp"),
]


@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha", "ignore:GDP accounting is experimental")
@pytest.mark.parametrize(("optimizer_class", "epsilon", "delta", "rate", "length", "accountant"), TARGETS)
def test_the_noise_multiplier_for_a_budget_is_opacuss_and_spends_at_most_that_budget(
    optimizer_class: type, epsilon: float, delta: float, rate: float, length: dict[str, int], accountant: str
) -> None:
    """Opacus's ``make_private_with_epsilon`` had no counterpart: one called ``get_noise_multiplier`` by hand.
    ``noise_multiplier_for`` is that function's answer on the same inputs, and a run of that length at it spends
    at most the budget by the same accountant."""
    from opacus.accountants.utils import get_noise_multiplier

    from inputaware_optim.accounting import PrivacyAccountant

    sigma = optimizer_class.noise_multiplier_for(
        epsilon=epsilon, delta=delta, sample_rate=rate, accountant=accountant, **length
    )
    expected = get_noise_multiplier(
        target_epsilon=epsilon, target_delta=delta, sample_rate=rate, accountant=accountant, **length
    )
    assert sigma == expected
    steps = length.get("steps") or int(length["epochs"] / rate)
    spent = PrivacyAccountant()
    spent.history = [(sigma, rate, steps)]
    assert epsilon - 0.01 <= spent.epsilon(delta, accountant) <= epsilon


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"epsilon": 0.0}, "Invalid epsilon: 0.0"),
        ({"delta": 1.0}, "Invalid delta: 1.0"),
        ({"sample_rate": 1.5}, "Invalid sample_rate: 1.5"),
        ({"steps": None}, "Give steps or epochs, exactly one"),
        ({"epochs": 1}, "Give steps or epochs, exactly one"),
        ({"steps": 0}, "Invalid steps: 0"),
        ({"accountant": "moments"}, "Invalid accountant: 'moments'"),
    ],
)
def test_the_noise_multiplier_for_a_budget_refuses_bad_arguments_by_name(change: dict[str, Any], message: str) -> None:
    arguments = {"epsilon": 1.0, "delta": 1e-5, "sample_rate": 0.01, "steps": 100, **change}
    with pytest.raises(ValueError, match=message):
        DPSGD.noise_multiplier_for(**arguments)


def test_a_raised_noise_does_not_lower_the_epsilon_already_spent_and_a_resumed_run_reports_it() -> None:
    """sigma 0.6 then 4.0 (the issue's case, shortened): the epsilon of both phases is Opacus's over
    both, by its PRV accountant (the default) and RDP; a run resumed from a state dict saved after
    the first phase reports the same as the uninterrupted one, and ``gdp`` refuses a changing noise."""
    sigmas = [0.6] * 30 + [4.0] * 30
    model = nn.Linear(5, 2).double()
    optimizer = DPSGD(model, lr=0.1, max_grad_norm=1.0, noise_multiplier=0.6, sample_rate=0.05)
    private_steps(optimizer, model, sigmas[:30])
    saved = optimizer.state_dict()
    after_first = optimizer.epsilon(1e-5)
    private_steps(optimizer, model, sigmas[30:], seed=30)
    assert optimizer.privacy_history == [(0.6, 0.05, 30), (4.0, 0.05, 30)]
    for mechanism in ("prv", "rdp"):
        expected = opacus_epsilon(sigmas, 0.05, 1e-5, mechanism)
        assert optimizer.epsilon(1e-5, accountant=mechanism) == pytest.approx(expected, rel=1e-9)
    assert optimizer.epsilon(1e-5) >= after_first
    with pytest.raises(ValueError, match="'gdp' accountant composes one noise multiplier"):
        optimizer.epsilon(1e-5, accountant="gdp")

    resumed_model = nn.Linear(5, 2).double()
    resumed = DPSGD(resumed_model, lr=0.1, max_grad_norm=1.0, noise_multiplier=4.0, sample_rate=0.05)
    resumed.load_state_dict(saved)
    assert resumed.epsilon(1e-5) == pytest.approx(after_first, rel=1e-12)
    private_steps(resumed, resumed_model, sigmas[30:], seed=30)
    assert resumed.epsilon(1e-5) == pytest.approx(optimizer.epsilon(1e-5), rel=1e-12)


def test_a_torch_distributed_checkpoint_round_trip_keeps_the_noise_and_the_privacy_history(tmp_path: Any) -> None:
    """torch.distributed.checkpoint (how FSDP2 runs save) keeps only ``state`` and ``param_groups``:
    the noise generator and the privacy history, kept beside them, were dropped (a resumed run
    redrew the noise of its first steps and reported the epsilon of its own steps only), and its
    state initialization (a step on zero gradients, no backward) was refused. Now the resumed run
    is the uninterrupted one, bitwise, with its whole history."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    def make() -> tuple[nn.Module, DPSGD]:
        torch.manual_seed(0)
        model = nn.Linear(5, 2).double()
        generator = torch.Generator().manual_seed(0)
        return model, DPSGD(model, lr=0.1, noise_multiplier=0.6, sample_rate=0.05, generator=generator)

    uninterrupted, reference = make()
    private_steps(reference, uninterrupted, [0.6] * 6)
    model, optimizer = make()
    private_steps(optimizer, model, [0.6] * 3)
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=tmp_path)
    resumed_model, resumed = make()
    loaded = {"model": resumed_model.state_dict(), "optim": get_optimizer_state_dict(resumed_model, resumed)}
    dcp.load(loaded, checkpoint_id=tmp_path)
    resumed_model.load_state_dict(loaded["model"])
    set_optimizer_state_dict(resumed_model, resumed, loaded["optim"])
    assert resumed.privacy_history == [(0.6, 0.05, 3)]
    private_steps(resumed, resumed_model, [0.6] * 3, seed=3)
    assert resumed.privacy_history == reference.privacy_history == [(0.6, 0.05, 6)]
    assert torch.equal(resumed_model.weight, uninterrupted.weight) and torch.equal(
        resumed_model.bias, uninterrupted.bias
    )


# -- 7. empty batches --------------------------------------------------------------------------

EMPTY_BATCHES = {
    "Linear": (lambda: nn.Sequential(nn.Linear(5, 3)), (0, 5)),
    "Conv2d": (lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(27, 2)), (0, 2, 5, 5)),
    "Embedding": (lambda: nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2)), (0, 3)),
    "GroupNorm": (lambda: nn.Sequential(nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(12, 2)), (0, 4, 3)),
}


def empty_input(name: str) -> torch.Tensor:
    shape = EMPTY_BATCHES[name][1]
    return torch.zeros(shape, dtype=torch.long) if name == "Embedding" else torch.zeros(shape)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(EMPTY_BATCHES))
def test_an_empty_batch_takes_a_noise_only_step(name: str, reduction: str) -> None:
    """Poisson sampling draws empty batches; Opacus then steps with the noise alone, divided by the
    expected batch size (mean) or not (sum). The private gradient is the generator's draws times
    ``sigma * C`` (over ``E``), parameter by parameter, as the same stream drawn by hand gives."""
    torch.manual_seed(0)
    model = EMPTY_BATCHES[name][0]()
    clip, sigma, expected_batch = 0.5, 1.3, 8
    optimizer = DPSGD(
        model,
        lr=1.0,
        max_grad_norm=clip,
        noise_multiplier=sigma,
        loss_reduction=reduction,
        expected_batch_size=expected_batch if reduction == "mean" else None,
        generator=torch.Generator().manual_seed(11),
    )
    output = model(empty_input(name))
    (output.sum() if reduction == "sum" else output.flatten(1).sum(1).mean()).backward()
    optimizer.step()
    stream = torch.Generator().manual_seed(11)
    divisor = expected_batch if reduction == "mean" else 1
    for key, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=stream) * (sigma * clip / divisor)
        torch.testing.assert_close(param.grad, noise, rtol=1e-6, atol=1e-7, msg=key)


class Routed(nn.Module):
    """Two experts; the batch goes to the one ``route`` names (``both``: through ``a``, with ``b``'s output times 0)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.a, self.b, self.head = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 1)
        self.route = "a"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = self.a(h) + 0 * self.b(h) if self.route == "both" else getattr(self, self.route)(h)
        return self.head(h)


@pytest.mark.parametrize("optimizer_class", [DPSGD, DPAdamW])
def test_a_parameter_no_sample_reached_is_noised_as_one_reached_with_a_zero_gradient(optimizer_class: type) -> None:
    """An expert no sample was routed to (its gradient stays None) is released as DP-SGD releases every trained
    parameter: its clipped sum is zero, its noise is not. Left unmoved, it would tell that no sample of the
    batch chose it. The run equals, bitwise, one where the expert is called and contributes exactly zero."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    runs = {}
    for route in ("a", "both"):
        model = Routed()
        model.route = route
        optimizer = optimizer_class(
            model, lr=0.1, max_grad_norm=0.5, noise_multiplier=1.0, generator=torch.Generator().manual_seed(5)
        )
        before = model.b.weight.detach().clone()
        for _ in range(2):
            optimizer.zero_grad()
            model(x).mean().backward()
            assert (model.b.weight.grad is None) == (route == "a")
            optimizer.step()
        assert not torch.equal(model.b.weight, before)  # the noise moved the idle expert
        assert optimizer.privacy_history == [(1.0, None, 2)]
        runs[route] = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(p, q) for p, q in zip(runs["a"], runs["both"], strict=True))


def test_a_gradient_not_cleared_since_the_last_step_is_refused_saying_zero_grad() -> None:
    """Without zero_grad() the next backward adds to the private gradient the last step wrote: it no longer
    adds up to this step's per-sample gradients, so it is refused, naming the likely cause."""
    model = nn.Linear(3, 1).double()
    optimizer = DPSGD(model, lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)
    model(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
    optimizer.step()
    model(torch.randn(4, 3, dtype=torch.float64)).sum().backward()  # (no zero_grad)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"do not add up .* still holding the last step's \(call zero_grad\(\)"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_parameters_that_require_grad_outside_the_optimizer_are_named_once_as_not_private() -> None:
    """A second optimizer on the rest of the model (or a gradient norm logged from it) reads gradients DP never
    clipped or noised: said once, by name, at the first step and again when the set changes; a parameter
    outside that got no gradient (a teacher run under no_grad) is not named."""

    class WithTeacher(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
            self.teacher = nn.Linear(3, 1)  # requires grad, outside the optimizer, used under no_grad only

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.teacher(x)
            return self.body(x)

    model = WithTeacher()
    optimizer = DPSGD(model, lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0, params=list(model.body[0].parameters()))
    x = torch.randn(8, 3)

    def step() -> list[str]:
        optimizer.zero_grad()
        model(x).sum().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
        return [str(w.message) for w in caught if "not among its params" in str(w.message)]

    (first,) = step()
    assert "2 parameter(s)" in first and "(body.2.weight, body.2.bias)" in first and "requires_grad_(False)" in first
    assert step() == []  # the same set: said once
    model.body[2].requires_grad_(False)
    assert step() == []
    model.body[2].bias.requires_grad_(True)
    (again,) = step()
    assert "1 parameter(s)" in again and "(body.2.bias)" in again


@pytest.mark.parametrize("name", list(EMPTY_BATCHES))
def test_an_empty_batch_without_the_expected_batch_size_is_refused_as_empty(name: str) -> None:
    torch.manual_seed(0)
    model = EMPTY_BATCHES[name][0]()
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.5, noise_multiplier=1.0)
    model(empty_input(name)).flatten(1).sum(1).mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"the batch of this step is empty .* Pass expected_batch_size"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


# -- 11. errors in the per-sample code ---------------------------------------------------------


class PerSampleFailure(ArithmeticError):
    """An error type of the test's own, raised where a layer's per-sample rule runs."""


def test_an_error_in_the_per_sample_code_keeps_its_type_and_traceback_and_names_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The per-sample code runs in a hook at the end of backward; what it raises reaches ``step()``
    as the same type, raised from the original (whose traceback reaches the failing function), with
    the module, which call and its input shapes in the message."""
    from inputaware_optim.layers import layer_kind

    def failing(kind: Any, module: nn.Module, call: Any, names: Any) -> Any:
        if module is model.middle:
            raise PerSampleFailure("the rule failed here")
        return original(kind, module, call, names)

    model = Chain().double()
    kind_type = type(layer_kind(model.middle))
    original = kind_type.per_sample
    monkeypatch.setattr(kind_type, "per_sample", failing)
    optimizer = DPSGD(model, lr=0.5, max_grad_norm=0.05, noise_multiplier=0.0)
    loss_of(model(batch(4, seed=1))).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PerSampleFailure) as raised:
        optimizer.step()
    message = str(raised.value)
    assert "per-sample gradients of middle (Linear), call 1 of 1 in one forward, on inputs of shape 4x6" in message
    assert "PerSampleFailure: the rule failed here" in message
    cause = raised.value.__cause__
    assert isinstance(cause, PerSampleFailure)
    assert traceback.extract_tb(cause.__traceback__)[-1].name == "failing"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


# -- 3. reentrant activation checkpointing -----------------------------------------------------


class Regions(nn.Module):
    """``Chain`` with its middle (and optionally its head) in checkpointed regions."""

    def __init__(self, reentrant: bool | None, head_too: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.middle, self.head = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 2)
        self.reentrant, self.head_too = reentrant, head_too

    def _run(self, function: Any, h: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            return function(h)
        return checkpoint(function, h, use_reentrant=self.reentrant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._run(lambda h: torch.tanh(self.middle(torch.tanh(h))), self.first(x))
        return self._run(self.head, h) if self.head_too else self.head(h)


@pytest.mark.parametrize("head_too", [False, True], ids=["one region", "two regions"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_is_exact_or_refused_by_name(reentrant: bool, head_too: bool) -> None:
    """Non-reentrant checkpointing: the step equals vmap(grad)'s per-sample clipping (of the same
    model without checkpoints). Reentrant: each region's backward is a pass of its own, which would
    clip each region's share on its own; the step refuses, naming the modules and use_reentrant=False."""
    model = Regions(reentrant, head_too).double()
    x = batch(6, seed=5)
    expected = reference(Regions(None).double(), x, 0.05)
    optimizer = DPSGD(model, lr=0.5, max_grad_norm=0.05, noise_multiplier=0.0)
    loss_of(model(x)).backward()
    if not reentrant:
        optimizer.step()
        assert_grads(model, expected)
        return
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"separate backward passes \(.*middle.*\).* use_reentrant=False") as raised:
        optimizer.step()
    assert "head" in str(raised.value) and "first" in str(raised.value)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


# -- 5. the noise under data parallelism -------------------------------------------------------

NOISE_CLIP, NOISE_SIGMA, NOISE_LOCAL_BATCH, NOISE_SEED = 0.5, 1.7, 4, 5


def _noise_rank(rank: int, directory: str, port: int, world: int, out: str) -> None:
    """One DDP rank: a step on samples whose gradients are zero, so the update is the noise alone."""
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from tests.multiprocess import mark_done

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    layer = nn.Linear(100, 60, bias=False)
    nn.init.zeros_(layer.weight)
    model = DistributedDataParallel(layer)
    optimizer = DPSGD(
        model,
        lr=1.0,
        max_grad_norm=NOISE_CLIP,
        noise_multiplier=NOISE_SIGMA,
        expected_batch_size=NOISE_LOCAL_BATCH,
        generator=torch.Generator().manual_seed(NOISE_SEED),  # the same seed on every rank
    )
    model(torch.zeros(NOISE_LOCAL_BATCH, 100)).sum().backward()
    optimizer.step()
    update = -layer.weight.detach().clone()
    gathered = [torch.empty_like(update) for _ in range(world)]
    dist.all_gather(gathered, update)
    assert all(torch.equal(gathered[0], other) for other in gathered), "replicas diverged"
    if rank == 0:
        torch.save(update, out)
    dist.barrier()
    mark_done(directory, rank)
    os._exit(0)  # without torch's gloo teardown (see tests/multiprocess.py)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_the_noise_under_ddp_has_the_standard_deviation_of_one_draw(world: int, tmp_path: Any) -> None:
    """Under DDP the noise is drawn once for all ranks: the update's standard deviation is
    ``sigma * C / (global batch)`` whatever the rank count (every rank drawing would make it
    ``sqrt(world)`` or ``world`` times that), and it is exactly rank 0's generator stream."""
    import socket

    from tests.multiprocess import run_spawned

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "update.pt")
    run_spawned(_noise_rank, args=(port, world, out), world=world)
    update = torch.load(out)
    global_batch = NOISE_LOCAL_BATCH * world
    std = NOISE_SIGMA * NOISE_CLIP / global_batch
    ratio = update.std().item() / std  # 6000 draws: the estimate is within 3% of 1 (about 3.3 standard errors)
    assert abs(ratio - 1.0) < 0.03, f"noise std {ratio:.3f}x sigma * C / B with {world} ranks"
    stream = torch.Generator().manual_seed(NOISE_SEED)
    torch.testing.assert_close(update, torch.randn(update.shape, generator=stream) * std, rtol=1e-5, atol=1e-7)


def _per_rank_rank(rank: int, directory: str, port: int, out: str) -> None:
    """One of 2 DDP ranks, each with 4 of a global batch of 8: a step with expected_batch_size=4 (per rank), one
    with 8 (the global batch, the mistake), and an adaptive one; rank 0 saves what each step did."""
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from tests.multiprocess import mark_done

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    x = batch(8, seed=70)[4 * rank : 4 * rank + 4]
    results = {}
    for name, options in PER_RANK_RUNS.items():
        model = Chain().double()
        before = [p.detach().clone() for p in model.parameters()]
        wrapped = DistributedDataParallel(model)
        optimizer = DPSGD(wrapped, lr=1.0, noise_multiplier=0.0, **options)
        loss_of(wrapped(x)).backward()  # each rank's loss a mean over its own 4 samples
        optimizer.step()
        results[name] = ([b - p.detach() for b, p in zip(before, model.parameters(), strict=True)], optimizer)
    saved = {name: (update, opt.param_groups[0]["max_grad_norm"]) for name, (update, opt) in results.items()}
    if rank == 0:
        torch.save(saved, out)
    dist.barrier()
    mark_done(directory, rank)
    os._exit(0)  # without torch's gloo teardown (see tests/multiprocess.py)


PER_RANK_RUNS = {  # every sample clipped (max_grad_norm 1e-3), or adaptive
    "per rank": {"max_grad_norm": 1e-3, "expected_batch_size": 4},
    "global": {"max_grad_norm": 1e-3, "expected_batch_size": 8},
    "adaptive": {"max_grad_norm": 0.05, "expected_batch_size": 4, "target_unclipped_quantile": 0.5},
}


def test_expected_batch_size_is_per_rank_under_ddp(tmp_path: Any) -> None:
    """Under DDP ``expected_batch_size`` is the samples one rank's step averages over: 2 ranks x 4 take
    expected_batch_size=4, and step as one process on the 8 samples (the clipped sums and the batch are added
    over the ranks). The global 8 halves the step (the signal, and the noise with it). Adaptive clipping counts
    over both ranks: the next clip is one process's."""
    import socket

    from tests.multiprocess import run_spawned

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "steps.pt")
    run_spawned(_per_rank_rank, args=(port, out), world=2)
    ranks = torch.load(out)
    x = batch(8, seed=70)
    for name, options in PER_RANK_RUNS.items():
        model = Chain().double()
        before = [p.detach().clone() for p in model.parameters()]
        one = DPSGD(model, lr=1.0, noise_multiplier=0.0, **{**options, "expected_batch_size": 8})
        loss_of(model(x)).backward()
        one.step()
        whole = [b - p.detach() for b, p in zip(before, model.parameters(), strict=True)]
        update, clip = ranks[name]
        # (the global 8 scales each sample's gradient by 2 before clipping: half, to the clip factor's 1e-6)
        factor, rtol = (0.5, 1e-5) if name == "global" else (1.0, 1e-10)
        for theirs, ours in zip(update, whole, strict=True):
            torch.testing.assert_close(theirs, factor * ours, rtol=rtol, atol=1e-14)
        assert clip == pytest.approx(one.param_groups[0]["max_grad_norm"], rel=1e-12)
    assert ranks["adaptive"][1] != PER_RANK_RUNS["adaptive"]["max_grad_norm"]


# -- 6. bfloat16 autocast ----------------------------------------------------------------------


class Tokens(nn.Module):
    """A small language model; ``tied``: its head is the embedding's weight used without calling
    the embedding (``F.linear``), whose share of the gradient no captured call explains."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.body, self.norm = nn.Embedding(50, 32), nn.Linear(32, 64), nn.LayerNorm(64)
        self.out, self.head = nn.Linear(64, 32), nn.Linear(32, 50)
        self.tied = tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.out(torch.nn.functional.gelu(self.norm(self.body(self.embed(tokens)))))
        logits = torch.nn.functional.linear(h, self.embed.weight) if self.tied else self.head(h)
        return logits.mean(1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_steps_within_its_rounding_of_per_sample_clipping_and_still_catches_a_tie(dtype: torch.dtype) -> None:
    """Under ``torch.autocast("cpu", bfloat16)`` (Lightning's "bf16-mixed") autograd rounds each weight
    gradient to bfloat16, which the add-up check must allow for: the step is per-sample clipping
    (vmap(grad) in float64) up to bfloat16's rounding. A tied head's gap (several % of the gradient)
    is still refused."""
    tokens = torch.randint(0, 50, (8, 12), generator=torch.Generator().manual_seed(1))
    model = Tokens(tied=False)
    expected = reference(Tokens(tied=False).double(), tokens, 0.05)
    optimizer = DPSGD(model, lr=0.5, max_grad_norm=0.05, noise_multiplier=0.0)
    with torch.autocast("cpu", dtype=dtype):
        output = model(tokens)
    loss_of(output.float()).backward()
    optimizer.step()
    gap = sum((model.get_parameter(k).grad.double() - v).pow(2).sum() for k, v in expected.items()) ** 0.5
    whole = sum(v.pow(2).sum() for v in expected.values()) ** 0.5
    assert gap / whole < 4 * torch.finfo(dtype).eps  # rounding, in the forward and the backward

    tied = Tokens(tied=True)
    optimizer = DPSGD(tied, lr=0.5, max_grad_norm=0.05, noise_multiplier=0.0)
    with torch.autocast("cpu", dtype=dtype):
        output = tied(tokens)
    loss_of(output.float()).backward()
    with pytest.raises(RuntimeError, match=r"per-sample gradients of embed do not add up .*\(off by [0-9.]+%"):
        optimizer.step()


# -- 10. a trainer's gradient clip -------------------------------------------------------------


def test_a_clipped_gradient_is_refused_naming_the_trainer_settings() -> None:
    """``clip_grad_norm_`` after backward scales every gradient by one factor: the refusal says so,
    with that factor (clip_grad_norm_'s own, ``max_norm / total_norm``), and names the trainers'
    settings that do it."""
    model = Chain().double()
    optimizer = DPSGD(model, lr=0.5, max_grad_norm=0.05, noise_multiplier=0.0)
    loss_of(model(batch(6, seed=2))).backward()
    total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.01))
    factor = 0.01 / (total + 1e-6)
    with pytest.raises(RuntimeError) as raised:
        optimizer.step()
    message = str(raised.value)
    assert f"per-sample gradients times {factor:.4g}, for every parameter alike" in message
    assert "Trainer(gradient_clip_val=...)" in message and "TrainingArguments(max_grad_norm=1.0" in message
    assert "max_grad_norm=0" in message


def test_lightnings_gradient_clip_val_is_refused_by_its_name(tmp_path: Any) -> None:
    pl = pytest.importorskip("lightning.pytorch")

    class Private(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Chain().double()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return loss_of(self.net(batch[0]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return DPSGD(self.net, lr=0.1, max_grad_norm=1.0, noise_multiplier=0.0)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(batch(8, seed=3) * 50), batch_size=4)
    trainer = pl.Trainer(
        accelerator="cpu",
        precision="64-true",
        max_steps=1,
        gradient_clip_val=1e-4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(RuntimeError, match=r"rescaled after backward.*Lightning's Trainer\(gradient_clip_val=\.\.\.\)"):
        trainer.fit(Private(), data)


def test_hugging_faces_max_grad_norm_is_refused_by_its_name(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = Chain()

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": loss_of(self.net(x) - labels)}

    model = WithLoss()
    rows = batch(8, seed=3).float() * 50
    data = [{"x": row, "labels": torch.zeros(2)} for row in rows]
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=4,
        max_grad_norm=1e-4,  # the default is 1.0
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    optimizer = DPSGD(model, lr=0.1, max_grad_norm=1.0, noise_multiplier=0.0)
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=data, optimizers=(optimizer, None))
    with pytest.raises(RuntimeError, match=r"rescaled after backward.*TrainingArguments\(max_grad_norm=1.0"):
        trainer.train()


# -- 8. the README's Poisson recipe, against Opacus on the same draws --------------------------

POISSON_DRAWS = [[0, 4, 9], [1, 2, 3, 5, 6, 7, 8], [10, 11, 12, 13, 14], [2, 9]]  # batches of 3, 7, 5, 2
EXPECTED_BATCH = 4


def poisson_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(8)
    return torch.randn(15, 5, generator=generator, dtype=torch.float64), torch.randint(0, 3, (15,), generator=generator)


def opacus_poisson_run(clip: float) -> list[torch.Tensor]:
    """Opacus's semantics for Poisson batches: the loss a mean over the drawn batch, each sample's
    gradient multiplied back by the drawn size, the clipped sum divided by the expected batch size."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    x, y = poisson_data()
    model = GradSampleModule(_poisson_model())
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        noise_multiplier=0.0,
        max_grad_norm=clip,
        expected_batch_size=EXPECTED_BATCH,
        loss_reduction="mean",
    )
    for draw in POISSON_DRAWS:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[draw]), y[draw]).backward()
        optimizer.step()
    return [p.detach().clone() for p in model._module.parameters()]


def _poisson_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


@pytest.mark.parametrize("clip", [0.05, 100.0], ids=["clipped", "unclipped"])
def test_the_readme_poisson_recipe_is_opacus_on_the_same_draws(clip: float) -> None:
    """The README's recipe: the loss of a drawn batch is its *sum* over the expected batch size, so
    that each sample's own gradient is exactly its loss's (a mean over the drawn ``n`` would scale it
    by ``E / n`` before clipping: 1.43x Opacus's update on unclipped samples in the issue's case)."""
    pytest.importorskip("opacus")
    x, y = poisson_data()
    model = _poisson_model()
    optimizer = DPSGD(model, lr=0.5, max_grad_norm=clip, noise_multiplier=0.0, expected_batch_size=EXPECTED_BATCH)
    for draw in POISSON_DRAWS:
        optimizer.zero_grad()
        (nn.functional.cross_entropy(model(x[draw]), y[draw], reduction="sum") / EXPECTED_BATCH).backward()
        optimizer.step()
    for p, q in zip(model.parameters(), opacus_poisson_run(clip), strict=True):
        torch.testing.assert_close(p.detach(), q, rtol=1e-9, atol=1e-12)


# -- adaptive clipping (Andrew et al. 2021) ----------------------------------------------------------


def sample_norms(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Each sample's own gradient norm (of ``|model(x_i)|²``, over every parameter), by vmap(grad)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_of_one(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (xi[None],)).pow(2).sum()

    per_sample = vmap(grad(loss_of_one), in_dims=(None, 0))(params, x)
    return torch.sqrt(sum(g.reshape(len(x), -1).pow(2).sum(1) for g in per_sample.values()))


def papers_clip(clip: float, norms: torch.Tensor, noise: float, m: float, group: dict[str, Any]) -> float:
    """The paper's geometric update, its count centered (each b_i - 1/2) and noised, over the step's batch m."""
    centered = float((norms <= clip).sum(dtype=torch.float64)) - 0.5 * len(norms) + noise
    fraction = centered / m + 0.5
    step = -group["clipbound_learning_rate"] * (fraction - group["target_unclipped_quantile"])
    return min(max(clip * math.exp(step), group["min_clipbound"]), group["max_clipbound"])


ADAPTIVE = {  # (target quantile, learning rate, min and max clip)
    "median": (0.5, 0.2, 0.0, math.inf),
    "upper quantile, clamped": (0.9, 1.0, 0.0, 0.33),
    "lower quantile, clamped": (0.1, 2.0, 0.29, math.inf),
}


@pytest.mark.parametrize("poisson", [False, True], ids=["fixed batches", "Poisson batches"])
@pytest.mark.parametrize("name", list(ADAPTIVE))
def test_adaptive_clipping_without_noise_is_the_papers_update_step_by_step(name: str, poisson: bool) -> None:
    """With the noise off the quantile update is deterministic: at every step the gradient is the clipped mean at
    the clip of that step (vmap(grad)), and the next clip is C exp(-eta (b - gamma)), b the fraction of samples
    whose norm is at most C, kept in [min_clipbound, max_clipbound], exactly. Under Poisson sampling (batches of
    3, 7, 5, 2, expected 4) b counts over the drawn batch and divides by the expected one, as the noise does."""
    quantile, rate, low, high = ADAPTIVE[name]
    model = Chain().double()
    optimizer = DPSGD(
        model,
        lr=0.5,
        max_grad_norm=0.3,
        noise_multiplier=0.0,
        expected_batch_size=4 if poisson else None,
        target_unclipped_quantile=quantile,
        clipbound_learning_rate=rate,
        min_clipbound=low,
        max_clipbound=high,
    )
    clips = [0.3]
    for step, size in enumerate([3, 7, 5, 2] if poisson else [6, 6, 6, 6]):
        group = optimizer.param_groups[0]
        x = batch(size, seed=40 + step)
        norms = sample_norms(model, x)
        expected = reference(model, x, clips[-1])
        if poisson:
            expected = {k: v * size / 4 for k, v in expected.items()}  # the clipped sum over the expected batch
        optimizer.zero_grad()
        (model(x).pow(2).flatten(1).sum(1).sum() / (4 if poisson else size)).backward()
        optimizer.step()
        assert_grads(model, expected)
        clips.append(papers_clip(clips[-1], norms, 0.0, 4 if poisson else size, group))
        assert group["max_grad_norm"] == clips[-1]
    assert len(set(clips)) > 1  # it moved
    if name != "median":
        assert clips[-1] == (high if quantile > 0.5 else low)
    assert optimizer.privacy_history == [(0.0, None, 4)]


def test_adaptive_clipping_with_noise_splits_it_and_accounts_the_noise_multiplier() -> None:
    """With the noise on, the gradient is noised at sigma_delta = (sigma^-2 - (2 sigma_b)^-2)^-1/2 (the generator's
    draws, parameter by parameter), the count at sigma_b (its next draw), and the clip moves by that noisy count.
    Gradient and count together are the Gaussian mechanism of the effective noise multiplier
    (sigma_delta^-2 + (2 sigma_b)^-2)^-1/2 = sigma: epsilon over the history is Opacus's accountant on it."""
    sigma, count_std, rate = 0.8, 1.5, 0.05
    model = Chain().double()
    optimizer = DPSGD(
        model,
        lr=0.5,
        max_grad_norm=0.3,
        noise_multiplier=sigma,
        sample_rate=rate,
        target_unclipped_quantile=0.5,
        unclipped_num_std=count_std,
        generator=torch.Generator().manual_seed(6),
    )
    gradient_sigma = (sigma**-2 - (2 * count_std) ** -2) ** -0.5
    stream = torch.Generator().manual_seed(6)
    clip = 0.3
    for step in range(3):
        group = optimizer.param_groups[0]
        x = batch(6, seed=50 + step)
        norms, expected = sample_norms(model, x), reference(model, x, clip)
        optimizer.zero_grad()
        loss_of(model(x)).backward()
        optimizer.step()
        for key, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=stream).double() * (gradient_sigma * clip / 6)
            torch.testing.assert_close(param.grad, expected[key] + noise, rtol=1e-9, atol=1e-12, msg=key)
        count_noise = float(torch.randn((), generator=stream)) * count_std
        clip = papers_clip(clip, norms, count_noise, 6, group)
        assert group["max_grad_norm"] == pytest.approx(clip, rel=1e-12)
    effective = (gradient_sigma**-2 + (2 * count_std) ** -2) ** -0.5
    assert optimizer.privacy_history == [(sigma, rate, 3)]
    assert optimizer.epsilon(1e-5, accountant="rdp") == pytest.approx(
        opacus_epsilon([effective] * 3, rate, 1e-5, "rdp"), rel=1e-9
    )


def test_adaptive_clipping_without_noise_follows_opacuss_adaclip() -> None:
    """Against Opacus's AdaClipDPOptimizer (fixed batches, where its conventions agree with the paper's; its
    count noise at 1e-12, as it requires noise_multiplier < 2 * unclipped_num_std even without noise): the same
    clips and the same parameters, step by step."""
    pytest.importorskip("opacus")
    from opacus import GradSampleModule
    from opacus.optimizers.adaclipoptimizer import AdaClipDPOptimizer

    options = {"target_unclipped_quantile": 0.5, "clipbound_learning_rate": 0.5, "max_clipbound": 10.0}
    ours, theirs = Chain().double(), GradSampleModule(Chain().double())
    optimizer = DPSGD(ours, lr=0.5, max_grad_norm=0.3, noise_multiplier=0.0, min_clipbound=1e-3, **options)
    opacus = AdaClipDPOptimizer(
        torch.optim.SGD(theirs.parameters(), lr=0.5),
        noise_multiplier=0.0,
        max_grad_norm=0.3,
        expected_batch_size=6,
        min_clipbound=1e-3,
        unclipped_num_std=1e-12,
        **options,
    )
    for step in range(5):
        x = batch(6, seed=60 + step)
        for model, each in ((ours, optimizer), (theirs, opacus)):
            each.zero_grad()
            loss_of(model(x)).backward()
            each.step()
        # (Opacus updates its clip in float32: exp of a float32 tensor)
        assert optimizer.param_groups[0]["max_grad_norm"] == pytest.approx(float(opacus.max_grad_norm), rel=1e-6)
        for p, q in zip(ours.parameters(), theirs._module.parameters(), strict=True):
            torch.testing.assert_close(p, q.detach(), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"noise_multiplier": 1.0}, r"Invalid unclipped_num_std: None with noise_multiplier=1.0.*Theorem 1"),
        ({"noise_multiplier": 1.0, "unclipped_num_std": 0.5}, r"Invalid unclipped_num_std: 0.5 with noise_mult"),
        ({"target_unclipped_quantile": 1.5}, r"Invalid target_unclipped_quantile: 1.5"),
        ({"clipbound_learning_rate": -1.0}, r"Invalid clipbound_learning_rate: -1.0"),
        ({"min_clipbound": 2.0, "max_clipbound": 1.0}, r"Invalid min_clipbound, max_clipbound: 2.0, 1.0"),
    ],
)
def test_adaptive_clipping_refuses_bad_hyperparameters_by_name(options: dict[str, Any], message: str) -> None:
    arguments = {"noise_multiplier": 0.0, "target_unclipped_quantile": 0.5, **options}
    model = Chain()
    with pytest.raises(ValueError, match=message):
        DPSGD(model, lr=0.1, **arguments)
    assert all(not m._forward_hooks for m in model.modules())
    optimizer = DPSGD(model, lr=0.1, noise_multiplier=1.0, target_unclipped_quantile=0.5, unclipped_num_std=1.0)
    optimizer.param_groups[0].update({"unclipped_num_std": None, **arguments})  # set since, refused at the step
    loss_of(model(batch(4, seed=1).float())).backward()
    with pytest.raises(ValueError, match=message):
        optimizer.step()


# -- virtual steps: Opacus's BatchMemoryManager -----------------------------------------------------


def _virtual_run(physical: int | None, noise: float, poisson: bool) -> tuple[list[torch.Tensor], list[Any], list[int]]:
    """One epoch over 32 samples in logical batches of 8 (expected, under Poisson sampling), each split by Opacus's
    BatchMemoryManager into physical batches of at most ``physical`` (None: one step per logical batch)."""
    from opacus.data_loader import DPDataLoader
    from opacus.utils.batch_memory_manager import BatchMemoryManager
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(8)
    x, y = torch.randn(32, 5, generator=generator, dtype=torch.float64), torch.randint(0, 3, (32,), generator=generator)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    if poisson:  # the same draws in both runs
        loader = DPDataLoader.from_data_loader(loader, generator=torch.Generator().manual_seed(4))
    model = _poisson_model()
    optimizer = DPSGD(
        model,
        lr=0.5,
        max_grad_norm=0.05,
        noise_multiplier=noise,
        expected_batch_size=8,
        sample_rate=0.25,
        generator=torch.Generator().manual_seed(5),
    )
    sizes = []

    def train(batches: Any) -> None:
        for xb, yb in batches:
            sizes.append(len(xb))
            optimizer.zero_grad()
            (nn.functional.cross_entropy(model(xb), yb, reduction="sum") / 8).backward()  # sum / expected batch
            optimizer.step()

    if physical is None:
        train(loader)
    else:
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=optimizer) as split:
            train(split)
    return [p.detach().clone() for p in model.parameters()], optimizer.privacy_history, sizes


@pytest.mark.parametrize("poisson", [False, True], ids=["fixed batches", "Poisson"])
@pytest.mark.parametrize("noise", [0.0, 1.3], ids=["noise off", "noise on"])
def test_opacus_batch_memory_manager_steps_as_one_step_per_logical_batch(noise: float, poisson: bool) -> None:
    """Opacus's BatchMemoryManager raised AttributeError (no signal_skip_step). Physical batches of at most 3
    now add up to the logical batch's step: every sample clipped, the noise drawn once from the same stream,
    one step accounted (float64, to rounding: the clipped sums add in another order)."""
    pytest.importorskip("opacus")
    whole, history, logical = _virtual_run(None, noise, poisson)
    split, split_history, physical = _virtual_run(3, noise, poisson)
    assert max(physical) <= 3 < max(logical) and sum(physical) == sum(logical)
    assert split_history == history == [(noise, 0.25, len(logical))]
    for p, q in zip(split, whole, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_a_virtual_step_keeps_the_gradients_and_a_real_one_clears_them() -> None:
    """``signal_skip_step(True)``: the step and the zero_grad() after it change nothing; ``False``: both act."""
    model = Chain().double()
    optimizer = DPSGD(model, lr=0.5, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=4)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.signal_skip_step(do_skip=True)
    loss_of(model(batch(2, seed=1))).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert optimizer.step(lambda: torch.tensor(2.0)) == 2.0  # a closure runs, its loss returned
    optimizer.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    optimizer.signal_skip_step(do_skip=False)
    loss_of(model(batch(2, seed=2))).backward()
    optimizer.step()
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters()) and optimizer.privacy_history == [(0.0, None, 1)]


def test_a_virtual_step_under_grad_scaler_is_refused() -> None:
    model = Chain()
    optimizer = DPSGD(model, lr=0.5, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=4)
    scaler = torch.amp.GradScaler("cpu")
    optimizer.signal_skip_step(True)
    scaler.scale(loss_of(model(batch(2, seed=1).float()))).backward()
    with pytest.raises(RuntimeError, match=r"virtual step .* under GradScaler"):
        scaler.step(optimizer)


# -- 9. Opacus's recurrent layers: exact batch-first and padded, refused otherwise -------------


@pytest.mark.parametrize("layout", ["sequence-first", "packed"])
@pytest.mark.parametrize("name", ["DPLSTM", "DPGRU", "DPRNN"])
def test_opacus_recurrent_layers_sequence_first_or_packed_are_refused(name: str, layout: str) -> None:
    """The README's claim, narrowed: Opacus's DPLSTM / DPGRU / DPRNN are exact batch-first on padded
    tensors (tests/test_layers.py, against vmap(grad)); sequence-first (with a sequence length other
    than the batch size) and PackedSequence inputs are refused at the step, changing nothing."""
    layers = pytest.importorskip("opacus.layers")

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.rnn, self.head = getattr(layers, name)(4, 5, batch_first=layout == "packed"), nn.Linear(5, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if layout == "packed":
                packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([6, 5, 3]), batch_first=True)
                return self.head(nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True)[0][:, -1])
            return self.head(self.rnn(x)[0][-1])

    model = Recurrent().double()
    shape = (3, 6, 4) if layout == "packed" else (6, 3, 4)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    optimizer = DPSGD(model, lr=0.5, max_grad_norm=0.05, noise_multiplier=0.0)
    model(x).pow(2).sum(1).mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="No parameter was changed"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


class _Recurrent(nn.Module):
    """Opacus's DPLSTM on a batch of 3 sequences of up to 6 steps: sequence-first, packed or padded batch-first."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        layers = pytest.importorskip("opacus.layers")
        torch.manual_seed(0)
        self.rnn, self.head = layers.DPLSTM(4, 5, batch_first=layout != "sequence-first"), nn.Linear(5, 2)
        self.layout = layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "packed":
            packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([6, 5, 3]), batch_first=True)
            return self.head(nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True)[0][:, -1])
        out = self.rnn(x)[0]
        return self.head(out[-1] if self.layout == "sequence-first" else out[:, -1])


@pytest.mark.parametrize(
    ("layout", "batch_dim", "message"),
    [
        (
            "sequence-first",
            0,
            r"^rnn \(DPLSTM\) got sequence-first input \(T, B, \.\.\.\), batch_first=False: its layers \(rnn.l0.ih, "
            r"rnn.l0.hh\) are called once per time step, 6 steps on a batch of 3 samples each, while the model's input "
            r"\(6, 3, 4\) holds the batch along dim 1.*Construct it with batch_first=True and pass it padded \(B, T, "
            r"\.\.\.\) tensors, \(3, 6, \.\.\.\) here",
        ),
        (
            "sequence-first",
            1,
            r"^rnn \(DPLSTM\) is read with batch_dim=1, but its layers .* on \(B, features\) tensors, \(3, 4\) here: "
            r"their dim 1 holds features, not samples.*batch_first=True.*\(3, 6, \.\.\.\).*with batch_dim=0",
        ),
        (
            "packed",
            0,
            r"^rnn \(DPLSTM\) got a PackedSequence: .* batches of 3, 3, 3, 2, 2, 1 \(a batch of 3 sequences, the "
            r"longest 6 steps\).*Pass it padded \(B, T, \.\.\.\) tensors, \(3, 6, \.\.\.\) here.*pad_packed_sequence",
        ),
    ],
    ids=["sequence-first", "sequence-first, batch_dim=1", "packed"],
)
def test_a_dplstm_fed_sequence_first_or_packed_input_is_refused_naming_the_layout(
    layout: str, batch_dim: int, message: str
) -> None:
    """The refusal named neither layout, and its numbers misled: "it holds 5 samples" (the hidden size, read as
    the batch under batch_dim=1) for a batch of 3. It names the DPLSTM, the layout, the batch (3) and the steps
    (6), and says what to do: batch_first=True, padded (B, T, ...) tensors. Padded batch-first is exact."""
    model = _Recurrent(layout).double()
    shape = (6, 3, 4) if layout == "sequence-first" else (3, 6, 4)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    optimizer = DPSGD(model, lr=0.5, max_grad_norm=0.05, noise_multiplier=0.0, batch_dim=batch_dim)
    loss_of(model(x)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=message + r".*No parameter was changed$"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    padded = _Recurrent("padded").double()  # the advice taken: batch_first=True on (3, 6, 4), exact
    x = x.transpose(0, 1) if layout == "sequence-first" else x
    expected = reference(_Recurrent("padded").double(), x, 0.05)
    optimizer = DPSGD(padded, lr=0.5, max_grad_norm=0.05, noise_multiplier=0.0)
    loss_of(padded(x)).backward()
    optimizer.step()
    assert_grads(padded, expected)


# -- a model copied with DP's hooks on it --------------------------------------------------------


def test_a_model_copied_after_dp_was_built_runs_and_sheds_every_hook() -> None:
    """An EMA twin (``copy.deepcopy(model)``) carries DP's root-batch hook and the capture's hooks;
    it has no optimizer, so the hooks record nothing and come off at its first forward."""
    model = Chain().double()
    optimizer = DPSGD(model, lr=0.5, max_grad_norm=0.05, noise_multiplier=0.0)
    twin = copy.deepcopy(model)
    twin(batch(3, seed=1))
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in twin.modules())
    loss_of(model(batch(3, seed=1))).backward()  # the original still steps
    optimizer.step()


def test_a_copied_optimizer_steps_as_the_original_with_its_noise_and_history() -> None:
    """``copy.deepcopy`` / ``pickle`` of a DPSGD mid-run: the copy draws the noise the original draws
    next and carries the privacy history, so both take the same step and report the same epsilon."""
    model = Chain().double()
    optimizer = DPSGD(model, lr=0.5, max_grad_norm=0.05, noise_multiplier=1.0, sample_rate=0.1)
    private_steps(optimizer, model, [1.0, 2.0])
    copies = [copy.deepcopy(optimizer), pickle.loads(pickle.dumps(optimizer))]
    for each in [optimizer, *copies]:
        private_steps(each, each.model, [2.0], seed=7)
    for each in copies:
        assert each.privacy_history == optimizer.privacy_history == [(1.0, 0.1, 1), (2.0, 0.1, 2)]
        for p, q in zip(each.model.parameters(), model.parameters(), strict=True):
            assert torch.equal(p, q)


def test_zero_gradients_without_a_backward_are_a_step_without_data_only_at_learning_rate_0() -> None:
    # At learning rate 0 (torch.distributed.checkpoint's state initialization) nothing is released;
    # at any other rate a step the caller took without a forward (a skipped empty Poisson batch)
    # must still be noised as an empty batch is, so it is refused, as before.
    model = nn.Linear(5, 2).double()
    optimizer = DPSGD(model, lr=0.1, noise_multiplier=1.0, sample_rate=0.05)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    with pytest.raises(RuntimeError, match="no forward call"):
        optimizer.step()
    optimizer.param_groups[0]["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert optimizer.privacy_history == []
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_noise_of_a_cuda_model_is_drawn_on_its_device() -> None:
    # It was drawn on the CPU (a model-sized draw, then a copy to the device, every step).
    model = nn.Linear(4, 3).cuda()
    optimizer = DPSGD(model, lr=0.1)
    assert optimizer.rules[0]._generator.device == next(model.parameters()).device
    model(torch.randn(5, 4, device="cuda")).sum().backward()
    optimizer.step()
