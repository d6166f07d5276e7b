"""Odd but legal loops and bad inputs: never a silently different number, never a half step."""

from __future__ import annotations

import copy
import gc
import threading
import warnings
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from inputaware_optim import DPSGD, FOOF, KFAC, NLMS, CoverageWarning, Eva, InputAwareSGD, LazyAdamW

from .conftest import hooks_on, mlp
from .test_capture import Recorder


class Experts(nn.Module):
    """Two experts; the second gets no token this step (an empty routing)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.busy, self.idle = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.busy(x).pow(2).sum() + self.idle(x[:0]).pow(2).sum()


@pytest.mark.parametrize("cls", [FOOF, KFAC, NLMS])
def test_a_layer_with_no_rows_this_step_is_skipped_not_poisoned(cls: type) -> None:
    model = Experts().double()
    optimizer = cls(model, lr=0.1)
    idle = model.idle.weight.detach().clone()
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 4, dtype=torch.float64)).backward()
        optimizer.step()  # a NaN moment would make every later refresh raise "diverged"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    torch.testing.assert_close(model.idle.weight, idle)  # a zero gradient moved nothing
    assert "input_second_moment" not in optimizer.rules[0].state[model.idle.weight]


@pytest.mark.parametrize("cls", [FOOF, NLMS])
def test_a_weight_shared_by_two_modules_is_one_layer_with_both_calls(cls: type) -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.first, self.second = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
            self.second.weight = self.first.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(torch.tanh(self.first(x))).pow(2).sum()

    model = Shared().double()
    kwargs = {"update_every": 1, "momentum": 0.0, "damping": 0.1} if cls is FOOF else {"damping": 1e-6}
    optimizer = cls(model, lr=1.0, **kwargs)
    x = torch.randn(6, 4, dtype=torch.float64)
    optimizer.zero_grad()
    model(x).backward()
    grad = model.first.weight.grad.clone()
    rows = torch.cat([x, torch.tanh(model.first(x)).detach()])  # both owners' inputs: one layer
    before = model.first.weight.detach().clone()
    optimizer.step()
    if cls is FOOF:
        expected = grad @ torch.linalg.inv(rows.T @ rows / 12 + 0.1 * torch.eye(4, dtype=torch.float64))
    else:
        expected = grad / (1e-6 + rows.pow(2).sum() / 12)
    torch.testing.assert_close(before - model.first.weight, expected)  # preconditioned once, not twice


def test_dp_noise_resumes_from_a_state_dict_bitwise() -> None:
    def make() -> tuple[nn.Module, DPSGD]:
        torch.manual_seed(0)
        layer = nn.Linear(5, 3)
        return layer, DPSGD(layer, lr=0.1, max_grad_norm=1.0, noise_multiplier=1.0)

    def train(layer: nn.Module, optimizer: DPSGD, steps: range) -> None:
        for step in steps:
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            layer(x).pow(2).mean().backward()
            optimizer.step()

    straight, optimizer = make()
    train(straight, optimizer, range(4))
    first, saving = make()
    train(first, saving, range(2))
    saved = copy.deepcopy((first.state_dict(), saving.state_dict()))
    resumed, loading = make()  # the same seed: without the saved generator, step 3 would repeat step 1's noise
    resumed.load_state_dict(saved[0])
    loading.load_state_dict(saved[1])
    train(resumed, loading, range(2, 4))
    for p, q in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(p, q)


def test_dp_sparse_embedding_after_a_linear_changes_nothing_or_works() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Embedding(10, 4, sparse=True)
            self.head = nn.Linear(4, 2)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(tokens).mean(1))

    dense, sparse = Net().double(), Net().double()
    dense.embed.sparse = False
    tokens = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(0))
    for model in (dense, sparse):
        optimizer = DPSGD(model, lr=0.5, max_grad_norm=0.1, noise_multiplier=0.0)
        model(tokens).pow(2).sum(1).mean().backward()
        optimizer.step()
    for p, q in zip(sparse.parameters(), dense.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_lazy_adamw_with_rows_out_of_range_changes_nothing() -> None:
    from inputaware_optim import Call

    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 1))
    optimizer = LazyAdamW(model, lr=0.1)
    model(torch.randint(0, 10, (3, 2))).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    bad = {model[0]: [Call(model[0], (torch.tensor([[3, 42]]),), {})]}  # row 42 of a 10-row table
    with pytest.raises(ValueError, match=r"inputs of 0 index row 42"):
        optimizer.step(inputs=bad)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert not optimizer.state  # no step counter was bumped either


def test_an_expired_inputs_does_not_keep_the_hooks_alive() -> None:
    model = mlp()
    optimizer = Recorder(model, lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    kept: list[Any] = []
    optimizer.register_step_post_hook(lambda opt, args, kwargs: kept.append(opt._step_inputs))
    optimizer.step()
    handed = optimizer.log  # noqa: F841 - what the rule read, as plain tensors
    capture = weakref.ref(optimizer.capture)
    del optimizer
    gc.collect()
    assert capture() is None and hooks_on(model) == 0


def test_a_dropped_optimizer_takes_its_hooks_even_if_its_capture_is_kept() -> None:
    model = mlp()
    optimizer = Recorder(model, lr=0.1)
    capture = optimizer.capture
    del optimizer
    gc.collect()
    assert hooks_on(model) == 0
    model(torch.randn(2, 4)).sum().backward()
    assert capture.calls() == []  # records nothing any more


def test_threads_do_not_erase_each_others_calls() -> None:
    class Fragile(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
            h = self.a(x)
            if fail:
                started.wait()  # the other thread runs its whole forward and backward now
                finished.wait()
                raise RuntimeError("simulated")
            return self.b(h)

    model = Fragile()
    optimizer = Recorder(model, lr=0.0)
    started, finished = threading.Barrier(2), threading.Barrier(2)

    def good() -> None:
        started.wait()
        model(torch.randn(3, 4)).sum().backward()
        finished.wait()

    def bad() -> None:
        with pytest.raises(RuntimeError, match="simulated"):
            model(torch.randn(5, 4), fail=True)

    threads = [threading.Thread(target=good), threading.Thread(target=bad)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    optimizer.step()
    assert [x.shape[0] for x in optimizer.log[model.a]] == [3] and [x.shape[0] for x in optimizer.log[model.b]] == [3]


# -- drop-in deviations ----------------------------------------------------------------------


def test_a_param_group_dict_is_the_group_as_in_torch() -> None:
    model = mlp()
    optimizer = InputAwareSGD(model, params=model[0].parameters(), lr=0.1)
    group = {"params": model[2].parameters(), "lr": 0.5}
    optimizer.add_param_group(group)
    assert optimizer.param_groups[-1] is group
    group["lr"] = 0.25  # a scheduler-like change after adding
    assert optimizer.param_groups[-1]["lr"] == 0.25


def test_add_param_group_for_a_module_added_after_construction() -> None:
    model = mlp()
    optimizer = Recorder(model, lr=0.1)
    model.append(nn.Linear(3, 2))
    optimizer.add_param_group({"params": model[3].parameters()})
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    assert [x.shape for x in optimizer.log[model[3]]] == [torch.Size([2, 3])]


def test_add_param_group_keeps_torchs_errors_and_the_rules_validation() -> None:
    model = mlp()
    optimizer = FOOF(model, lr=0.1, params=model[0].parameters())
    with pytest.raises(KeyError):
        optimizer.add_param_group({"lr": 0.1})
    with pytest.raises(ValueError, match="Invalid update_every"):
        optimizer.add_param_group({"params": model[2].parameters(), "update_every": 0})
    assert len(optimizer.param_groups) == 1  # nothing half added
    dp = DPSGD(model, lr=0.1, params=model[0].parameters())
    with pytest.raises(ValueError, match="same values"):
        dp.add_param_group({"params": model[2].parameters(), "max_grad_norm": 5.0})
    copied = copy.deepcopy(optimizer)  # the same optimizer on a copy of the model: takes its groups
    copied.add_param_group({"params": copied.model[2].parameters()})
    with pytest.raises(ValueError, match="not a parameter of the model"):
        copied.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (FOOF, {"damping": float("inf")}, "Invalid damping"),
        (NLMS, {"damping": float("inf")}, "Invalid damping"),
        (DPSGD, {"max_grad_norm": float("inf")}, "Invalid max_grad_norm"),
        (DPSGD, {"noise_multiplier": float("inf")}, "Invalid noise_multiplier"),
        (KFAC, {"loss_reduction": "no"}, "Invalid loss_reduction"),
        (DPSGD, {"generator": 123}, "Invalid generator"),
    ],
)
def test_hyperparameters_that_cannot_work_are_refused_at_construction(
    cls: type, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        cls(mlp(), lr=0.1, **kwargs)


@pytest.mark.parametrize(
    ("cls", "key", "value"),
    [
        (Eva, "damping", 0.0),
        (KFAC, "damping", -1.0),
        (FOOF, "stat_decay", 1.5),
        (FOOF, "update_every", 0),
        (KFAC, "statistics_every", 0),
        (KFAC, "loss_reduction", "avg"),
        (Eva, "kl_clip", -1.0),
        (NLMS, "damping", -1.0),
        (DPSGD, "max_grad_norm", -1.0),
        (DPSGD, "noise_multiplier", -1.0),
        (DPSGD, "sample_rate", 2.0),
        (DPSGD, "expected_batch_size", 0),
    ],
)
def test_a_hyperparameter_set_in_param_groups_mid_run_is_checked_at_the_step(cls: type, key: str, value: Any) -> None:
    # Checked at construction only, these trained on silently (a stat_decay of 1.5 extrapolates the
    # running moments, a negative eps flips NLMS's step) or failed deep inside (division by zero).
    model = mlp()
    optimizer = cls(model, lr=0.1, **({"noise_multiplier": 0.0} if cls is DPSGD else {}))
    for step in range(2):
        optimizer.zero_grad()
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(step))).sum().backward()
        if step == 1:
            optimizer.param_groups[0][key] = value
            before = [p.detach().clone() for p in model.parameters()]
            state = copy.deepcopy(optimizer.state_dict()["state"])
            with pytest.raises(ValueError, match=rf"param group 0: Invalid {key}.*No parameter was changed"):
                optimizer.step()
            assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
            assert str(optimizer.state_dict()["state"]) == str(state)
        else:
            optimizer.step()


def test_numpy_integers_are_integers() -> None:
    optimizer = FOOF(mlp(), lr=0.1, update_every=np.int64(3))
    assert optimizer.param_groups[0]["update_every"] == 3


def test_a_stock_sgd_state_dict_loads_into_a_rule() -> None:
    model = mlp()
    stock = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    stock.step()
    for cls in (FOOF, NLMS):
        rule = cls(model, lr=0.1)
        rule.load_state_dict(stock.state_dict())
        rule.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        rule.step()  # used to raise KeyError: 'damping' / 'eps'


def test_kronecker_rules_follow_the_model_to_float64() -> None:
    model = mlp()
    optimizer = FOOF(model, lr=0.1, update_every=1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    model.double()
    optimizer.zero_grad()
    model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    optimizer.step()  # float32 running moments meet float64 statistics
    assert optimizer.rules[0].state[model[0].weight]["input_second_moment"].dtype == torch.float64


def test_inference_tensors_as_inputs_work_as_in_torch() -> None:
    class Shift(nn.Module):  # saves no input for backward, so torch accepts an inference tensor
        def __init__(self) -> None:
            super().__init__()
            self.shift = nn.Parameter(torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.shift

    model = Shift()
    optimizer = Recorder(model, lr=0.1)
    with torch.inference_mode():
        x = torch.randn(3, 4)
    model(x).sum().backward()  # used to raise: inference tensors have no version counter
    optimizer.step()
    assert [t.shape[0] for t in optimizer.log[model]] == [3]


def test_no_trainable_parameter_reports_torchs_hyperparameter_error_first() -> None:
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        InputAwareSGD(frozen, lr=-1.0)
    with pytest.raises(ValueError, match="nothing to train"):
        InputAwareSGD(frozen, lr=0.1)


def _clipped_reference(model: nn.Module, x: torch.Tensor, loss_of_one: Any, clip: float) -> dict[str, torch.Tensor]:
    """The textbook DP gradient without noise: vmap(grad) per sample, clipped, averaged."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}
    per_sample = vmap(grad(lambda p, xi: loss_of_one(functional_call(model, p, (xi[None],)))), in_dims=(None, 0))(
        params, x
    )
    norms = torch.sqrt(sum(g.reshape(len(x), -1).pow(2).sum(1) for g in per_sample.values()))
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    return {k: torch.tensordot(factors, g, dims=1) / len(x) for k, g in per_sample.items()}


def test_dp_with_a_module_called_several_times_per_forward_is_exact() -> None:
    class Recurrent(nn.Module):  # one cell applied three times: each sample's gradient sums its calls
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.cell, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x
            for _ in range(3):
                h = torch.tanh(self.cell(h))
            return self.head(h)

    model = Recurrent().double()
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = _clipped_reference(model, x, lambda out: out.pow(2).sum(), clip=0.05)
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.05, noise_multiplier=0.0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    model(x).pow(2).sum(1).mean().backward()
    optimizer.step()
    for name, param in model.named_parameters():
        torch.testing.assert_close(before[name] - param.detach(), expected[name], rtol=1e-8, atol=1e-12)


def test_dp_refuses_a_batch_norm_in_training_mode_even_without_parameters() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, affine=False), nn.Linear(3, 1))
    optimizer = DPSGD(model, lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"1 normalizes over the batch"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    model.eval()  # in eval mode it uses running statistics: no sample mixing
    optimizer.step()


def test_dp_clips_huge_float32_gradients_instead_of_dropping_them() -> None:
    torch.manual_seed(0)
    layer, twin = nn.Linear(3, 2), nn.Linear(3, 2).double()
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(4, 3) * 1e19  # squared norms near 1e40 overflow float32
    expected = _clipped_reference(twin, x.double(), lambda out: out.sum(), clip=1.0)
    optimizer = DPSGD(layer, lr=1.0, max_grad_norm=1.0, noise_multiplier=0.0)
    before = layer.weight.detach().double().clone()
    layer(x).sum(1).mean().backward()
    optimizer.step()
    torch.testing.assert_close((before - layer.weight.detach().double()), expected["weight"], rtol=1e-5, atol=1e-6)


def test_dp_refuses_a_weight_also_used_without_calling_its_module() -> None:
    """A tied head written F.linear(h, embed.weight) puts gradient in the table that no captured call
    explains: it cannot be clipped per sample, so the step is refused by name and changes nothing."""

    class TiedFunctionalHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(30, 4)
            self.mix = nn.Linear(4, 4)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(self.mix(self.embed(tokens).mean(1)), self.embed.weight)

    torch.manual_seed(0)
    model = TiedFunctionalHead()
    optimizer = DPSGD(model, lr=0.1, max_grad_norm=1e6, noise_multiplier=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randint(0, 30, (4, 3))).logsumexp(1).sum().backward()
    with pytest.raises(RuntimeError, match=r"per-sample gradients of embed do not add up.*F.linear"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


class _HalfComplex(nn.Module):
    """A real layer, then a complex one on its output (a complex-valued head)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.real, self.complex = nn.Linear(4, 6), nn.Linear(6, 3, dtype=torch.cfloat)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.complex(self.real(x).to(torch.cfloat)).abs().pow(2).sum()


@pytest.mark.parametrize("cls", [FOOF, KFAC, Eva, NLMS])
def test_a_complex_layer_falls_back_to_the_stock_update_with_the_reason(cls: type) -> None:
    # The layer kinds' rows and statistics are those of real layers (xᵀx, not xᴴx): a complex weight
    # was preconditioned with them silently (Eva, NLMS) or failed deep inside (K-FAC, FOOF).
    model, x = _HalfComplex(), torch.randn(5, 4)
    stock = copy.deepcopy(model)
    rule, sgd = cls(model, lr=0.1, momentum=0.0), torch.optim.SGD(stock.parameters(), lr=0.1)
    model(x).backward()
    stock(x).backward()
    with pytest.warns(CoverageWarning, match=r"complex\.weight \(Linear\): its weight is complex"):
        rule.step()
    sgd.step()
    treatments = {row.name: row.treatment for row in rule.coverage()}
    assert treatments["real.weight"].startswith(cls.__name__) and treatments["complex.weight"].startswith("stock")
    assert torch.equal(model.complex.weight, stock.complex.weight)
    assert torch.equal(model.complex.bias, stock.complex.bias)
    assert not torch.equal(model.real.weight, stock.real.weight)  # the real layer got the rule


def test_dp_refuses_complex_parameters_by_module() -> None:
    with pytest.raises(ValueError, match=r"per-sample gradients of complex \(Linear\): its parameters are complex"):
        DPSGD(_HalfComplex(), lr=0.1, max_grad_norm=1.0, noise_multiplier=1.0)


@pytest.mark.parametrize("cls", [FOOF, KFAC, Eva, NLMS])
def test_a_layer_pruned_mid_run_falls_back_with_the_reason_and_dp_refuses_it(cls: type) -> None:
    # torch.nn.utils.prune moves a weight to weight_orig and computes the weight in a hook. The rules
    # kept the layer they had found: they read the computed weight's .grad (torch warned of a non-leaf
    # tensor), left weight_orig to plain SGD without a word and reported the bias as preconditioned.
    model, x = mlp(), torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    optimizer = cls(model, lr=0.1, momentum=0.0)
    model(x).sum().backward()
    optimizer.step()
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    optimizer.zero_grad()
    model(x).sum().backward()
    pruned = {name: (p.detach().clone(), p.grad.clone()) for name, p in model[0].named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    messages = [str(w.message) for w in caught]
    assert any("0.weight_orig (Linear): its weight is computed from weight_orig" in m for m in messages), messages
    assert {w.filename for w in caught if issubclass(w.category, CoverageWarning)} == {__file__}  # step()'s caller
    assert not any("not a leaf Tensor" in m for m in messages), messages
    treatments = {row.name: row.treatment for row in optimizer.coverage()}
    assert treatments["0.weight_orig"].startswith("stock") and treatments["0.bias"].startswith("stock")
    assert not treatments["2.weight"].startswith("stock")
    for name, param in model[0].named_parameters():  # plain SGD without momentum
        before, grad = pruned[name]
        torch.testing.assert_close(param.detach(), before - 0.1 * grad, rtol=0, atol=1e-7)
    dp_model = mlp()
    dp = DPSGD(dp_model, lr=0.1, noise_multiplier=0.0)
    prune.l1_unstructured(dp_model[0], "weight", amount=0.5)
    dp_model(x).sum().backward()
    with pytest.raises(ValueError, match=r"0 \(Linear\): its parameters weight_orig.*prune\.remove"):
        dp.step()
