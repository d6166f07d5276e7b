"""The rule API: the library owns the step (the closure first, whoever steps), rules are transforms that chain
in front of any stock optimizer with one state, and a rule author's mistakes are refused by name."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from inputaware_optim import (
    DPSGD,
    FOOF,
    FOOFPreconditioner,
    InputAwareAdamW,
    InputAwareOptimizer,
    InputAwareSGD,
    InputNormalization,
    Inputs,
    Monitor,
    PerSampleClipping,
    Reduction,
    Rule,
)


class TrustRatio(Rule):
    """LARS's layer-wise trust ratio: each weight matrix's gradient scaled to ``coefficient * |w| / |g|``."""

    def __init__(self, coefficient: float = 0.5) -> None:
        self.defaults = {"trust_coefficient": coefficient}

    def check_group(self, group: dict[str, Any]) -> None:
        if not group["trust_coefficient"] > 0:
            raise ValueError(f"Invalid trust_coefficient: {group['trust_coefficient']} (must be > 0)")

    def update(self, optimizer: Any, inputs: Inputs) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.dim() >= 2:
                    self.state[p]["ratio"] = group["trust_coefficient"] * p.norm() / p.grad.norm()
                    p.grad.mul_(self.state[p]["ratio"])


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def batch(step: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def backward(model: nn.Module, step: int) -> torch.Tensor:
    model.zero_grad()
    loss = model(batch(step)).pow(2).mean()
    loss.backward()
    return loss


# -- the library runs the closure before any rule reads the inputs --------------------------------------------


class OverrideRule(InputAwareSGD):
    """The mission's headline: a step override that reads raw calls and ends in super().step()."""

    @torch.no_grad()
    def step(self, closure: Any = None, inputs: Inputs | None = None) -> Any:
        for p in self._params():
            seen = inputs.get(p) if inputs is not None else None
            if p.grad is not None and seen is not None:
                p.grad.div_(1 + seen.cat().pow(2).mean())
        return super().step(closure, inputs=inputs)


class TransformRule(Rule):
    """The same rule as a transform."""

    reads = "calls"

    def update(self, optimizer: Any, inputs: Inputs) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                seen = inputs.get(p)
                if p.grad is not None and seen is not None:
                    p.grad.div_(1 + seen.cat().pow(2).mean())


MAKERS: dict[str, Callable[[nn.Module], Any]] = {
    "override": lambda m: OverrideRule(m, lr=0.1, momentum=0.9),
    "transform": lambda m: InputAwareSGD(m, rules=[TransformRule()], lr=0.1, momentum=0.9),
    "FOOF": lambda m: FOOF(m, lr=0.1, update_every=1),
    "chain": lambda m: InputAwareAdamW(m, rules=[FOOFPreconditioner(update_every=1), TrustRatio()], lr=0.01),
}


@pytest.mark.parametrize("rule", list(MAKERS))
def test_a_rule_under_a_closure_is_the_rule_in_a_plain_loop(rule: str) -> None:
    # The README's template (an override ending in super().step(closure, inputs=inputs)) trained as stock SGD
    # under opt.step(closure): nothing was captured when it read its inputs, the closure ran later.
    plain_model, closure_model, stock_model = net(), net(), net()
    plain, closed = MAKERS[rule](plain_model), MAKERS[rule](closure_model)
    stock = torch.optim.SGD(stock_model.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        loss = backward(plain_model, step)
        plain.step()
        stock.zero_grad()
        backward(stock_model, step)
        stock.step()

        def closure(step: int = step) -> torch.Tensor:
            return backward(closure_model, step)

        assert torch.equal(closed.step(closure), loss)  # the closure's loss, returned as stock
    for p, q, r in zip(plain_model.parameters(), closure_model.parameters(), stock_model.parameters(), strict=True):
        assert torch.equal(p, q)
        assert not torch.allclose(p, r)  # the rule changed the update


def test_a_closure_runs_once_per_step_and_its_calls_are_the_steps() -> None:
    model = net()
    optimizer = OverrideRule(model, lr=0.1)
    runs = []

    def closure() -> torch.Tensor:
        runs.append(1)
        return backward(model, 0)

    optimizer.step(closure)
    assert len(runs) == 1


@pytest.mark.parametrize(
    "hook",
    [
        lambda o: Monitor(o, every=1),
        lambda o: o.register_inputs_hook(lambda opt, inputs: None, when="pre"),
        lambda o: o.register_step_pre_hook(lambda opt, args, kwargs: None),
        None,
    ],
    ids=["Monitor", "inputs hook", "step pre-hook", "none"],
)
def test_lbfgs_behind_a_drop_in_is_lbfgs_hooks_or_no_hooks(hook: Any) -> None:
    # With any pre-step hook the closure was evaluated once and LBFGS was handed a closure that always returned
    # that loss: 3 evaluations instead of 15, loss 0.899 against 0.488.
    def run(make: Callable[[nn.Module], Any], attach: Any) -> tuple[float, int]:
        model = net()
        optimizer = make(model)
        if attach is not None:
            attach(optimizer)
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        evaluations = []

        def closure() -> torch.Tensor:
            evaluations.append(1)
            optimizer.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        for _ in range(3):
            optimizer.step(closure)
        return float(model(x).pow(2).mean()), len(evaluations)

    stock = run(lambda m: torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=5), None)
    ours = run(lambda m: InputAwareSGD(m, lr=0.5, max_iter=5, base=torch.optim.LBFGS), hook)
    assert ours == stock
    assert stock[1] > 3


# -- rules compose ------------------------------------------------------------------------------------------


def test_a_chain_of_two_rules_is_the_hand_composition_bitwise() -> None:
    chained_model, hand_model = net(), net()
    chain = InputAwareAdamW(
        chained_model, rules=[FOOFPreconditioner(update_every=1), TrustRatio(0.5)], lr=0.01, weight_decay=0.1
    )
    # By hand: FOOF's transform behind an SGD whose step moves nothing, the trust ratio, then stock AdamW.
    foof = InputAwareSGD(hand_model, rules=[FOOFPreconditioner(update_every=1)], lr=0.0)
    adamw = torch.optim.AdamW(hand_model.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(5):
        backward(chained_model, step)
        chain.step()
        backward(hand_model, step)
        foof.step()
        with torch.no_grad():
            for p in hand_model.parameters():
                if p.dim() >= 2:
                    p.grad.mul_(0.5 * p.norm() / p.grad.norm())
        adamw.step()
    for p, q in zip(chained_model.parameters(), hand_model.parameters(), strict=True):
        assert torch.equal(p, q)
    for p, q in zip(chained_model.parameters(), hand_model.parameters(), strict=True):
        for key, value in adamw.state[q].items():
            assert torch.equal(chain.state[p][key], value), key  # the base's own state, where torch keeps it


def test_a_chains_state_dict_round_trip_resumes_bitwise() -> None:
    def make(model: nn.Module) -> Any:
        return InputAwareAdamW(model, rules=[FOOFPreconditioner(update_every=2), TrustRatio()], lr=0.01)

    whole_model, resumed_model = net(), net()
    whole, first = make(whole_model), make(resumed_model)
    for step in range(3):
        backward(whole_model, step)
        whole.step()
        backward(resumed_model, step)
        first.step()
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = make(resumed_model)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for rule, other in zip(resumed.rules, first.rules, strict=True):
        assert rule.state.keys() == other.state.keys()
    for step in range(3, 6):
        backward(whole_model, step)
        whole.step()
        backward(resumed_model, step)
        resumed.step()
    for p, q in zip(whole_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_chain_copies_with_its_rules_state() -> None:
    model = net()
    chain = InputAwareAdamW(model, rules=[FOOFPreconditioner(update_every=1), TrustRatio()], lr=0.01)
    for step in range(2):
        backward(model, step)
        chain.step()
    copied_model, copied = copy.deepcopy((model, chain))
    assert [type(r) for r in copied.rules] == [FOOFPreconditioner, TrustRatio]
    assert all(a is not b for a, b in zip(copied.rules, chain.rules, strict=True))
    for step in range(2, 4):
        backward(model, step)
        chain.step()
        backward(copied_model, step)
        copied.step()
    for p, q in zip(model.parameters(), copied_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_rule_reading_inputs_after_dp_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"InputNormalization reads the step's inputs after PerSampleClipping"):
        InputAwareSGD(net(), rules=[PerSampleClipping(), InputNormalization()], lr=0.1)
    with pytest.raises(ValueError, match=r"put PerSampleClipping first"):
        InputAwareSGD(net(), rules=[TrustRatio(), PerSampleClipping()], lr=0.1)
    with pytest.raises(ValueError, match=r"reads the step's inputs after"):
        DPSGD(net(), lr=0.1, rules=[FOOFPreconditioner()])
    # A rule that reads nothing of the batch may follow: what it sees is the private gradient.
    DPSGD(net(), lr=0.1, rules=[TrustRatio()])


def test_rules_keeping_one_hyperparameter_name_are_refused() -> None:
    with pytest.raises(ValueError, match=r"both keep 'damping'"):
        InputAwareSGD(net(), rules=[FOOFPreconditioner(), InputNormalization()], lr=0.1)


def test_a_rule_belongs_to_one_optimizer() -> None:
    rule = TrustRatio()
    first = InputAwareSGD(net(), rules=[rule], lr=0.1)
    with pytest.raises(ValueError, match="belongs to another optimizer"):
        InputAwareSGD(net(), rules=[rule], lr=0.1)
    assert first.rules == (rule,)


def test_a_chain_whose_later_rule_refuses_leaves_the_gradients_as_backward_made_them() -> None:
    class Refuses(Rule):
        def update(self, optimizer: Any, inputs: Inputs) -> None:
            raise RuntimeError("refused by the second rule")

    model = net()
    optimizer = InputAwareAdamW(model, rules=[FOOFPreconditioner(), Refuses()], lr=0.01)
    backward(model, 0)
    grads = [p.grad.clone() for p in model.parameters()]
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="refused by the second rule"):
        optimizer.step()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


# -- a composition is the base optimizer as torch users see it -------------------------------------------------


@pytest.mark.parametrize("rule", ["none", "FOOF", "TrustRatio"])
def test_state_of_a_base_adam_composition_is_stock_adams(rule: str) -> None:
    model, reference = net(), net()
    rules = {"none": [], "FOOF": [FOOFPreconditioner(update_every=1)], "TrustRatio": [TrustRatio()]}[rule]
    ours = InputAwareSGD(model, rules=rules, lr=0.01, base=torch.optim.Adam, amsgrad=True)
    stock = torch.optim.Adam(reference.parameters(), lr=0.01, amsgrad=True)
    for step in range(3):
        backward(model, step)
        ours.step()
        backward(reference, step)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            q.grad = p.grad.clone()  # what the rules handed the base
        stock.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert ours.state[p].keys() == stock.state[q].keys() == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
        for key in stock.state[q]:
            assert torch.equal(ours.state[p][key], stock.state[q][key]), key
    assert ours.base is torch.optim.Adam


def test_a_checkpoint_whose_step_is_a_number_loads_and_steps_as_stock() -> None:
    # Older checkpoints hold "step" as a number; stock Adam converts it, the composition crashed the next step.
    model, reference = net(), net()
    ours = InputAwareSGD(model, rules=[TrustRatio()], lr=0.01, base=torch.optim.Adam)
    stock = torch.optim.Adam(reference.parameters(), lr=0.01)
    backward(model, 0)
    ours.step()
    saved = ours.state_dict()
    for entry in saved["state"].values():
        entry["step"] = float(entry["step"])
    backward(reference, 0)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        q.grad = p.grad.clone()
    stock.step()
    stock_saved = stock.state_dict()
    for entry in stock_saved["state"].values():
        entry["step"] = float(entry["step"])
    ours.load_state_dict(saved)
    stock.load_state_dict(stock_saved)
    for p in model.parameters():
        assert torch.is_tensor(ours.state[p]["step"])
    backward(model, 1)
    ours.step()
    backward(reference, 1)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        q.grad = p.grad.clone()
    stock.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def test_state_dict_leaves_the_live_state_as_it_is_and_a_deleted_rule_state_stays_deleted() -> None:
    model = net()
    optimizer = InputAwareSGD(model, rules=[TrustRatio()], lr=0.01, base=torch.optim.Adam)
    backward(model, 0)
    optimizer.step()
    optimizer.state_dict()
    assert all("rule_state" not in entry for entry in optimizer.state.values())
    weight = next(model.parameters())
    del optimizer.rules[0].state[weight]
    saved = optimizer.state_dict()
    assert "rule_state" not in saved["state"][0]
    loaded = InputAwareSGD(net(), rules=[TrustRatio()], lr=0.01, base=torch.optim.Adam)
    loaded.load_state_dict(saved)
    assert len(loaded.rules[0].state) == len(optimizer.rules[0].state)


def test_a_loaded_lbfgs_base_keeps_lbfgs_groups() -> None:
    model = net()
    optimizer = InputAwareSGD(model, lr=0.5, base=torch.optim.LBFGS)
    keys = set(optimizer.param_groups[0])
    optimizer.load_state_dict(optimizer.state_dict())
    assert set(optimizer.param_groups[0]) == keys == set(torch.optim.LBFGS(net().parameters()).param_groups[0])


def test_a_rules_hyperparameters_are_group_keys_checked_before_every_step() -> None:
    model = net()
    optimizer = InputAwareAdamW(model, rules=[TrustRatio(0.5)], lr=0.01)
    assert optimizer.param_groups[0]["trust_coefficient"] == 0.5
    with pytest.raises(ValueError, match="Invalid trust_coefficient"):
        InputAwareAdamW(net(), rules=[TrustRatio(-1.0)], lr=0.01)
    optimizer.param_groups[0]["trust_coefficient"] = 0.0
    backward(model, 0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"param group 0: Invalid trust_coefficient.*No parameter was changed"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_any_stock_optimizer_behind_rules_of_ones_own() -> None:
    model, reference = net(), net()
    ours = InputAwareOptimizer(model, rules=[TrustRatio()], base=torch.optim.RMSprop, lr=0.01)
    stock = torch.optim.RMSprop(reference.parameters(), lr=0.01)
    for step in range(3):
        backward(model, step)
        ours.step()
        backward(reference, step)
        with torch.no_grad():
            for q in reference.parameters():
                if q.dim() >= 2:
                    q.grad.mul_(0.5 * q.norm() / q.grad.norm())
        stock.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    with pytest.raises(TypeError, match="pass base="):
        InputAwareOptimizer(net(), rules=[TrustRatio()], lr=0.01)


# -- a rule author's mistakes are refused by name ----------------------------------------------------------


class Power(Reduction):
    def forward(self, call: Any) -> torch.Tensor:
        return call.input.pow(2).sum()


def test_reading_an_unregistered_reduction_is_refused_naming_reads() -> None:
    power = Power()

    class Forgot(Rule):
        layers = "input_rows"  # (reads something, but never declared power)

        def update(self, optimizer: Any, inputs: Inputs) -> None:
            inputs.reduced(power)

    model = net()
    optimizer = InputAwareSGD(model, rules=[Forgot()], lr=0.1)
    backward(model, 0)
    with pytest.raises(RuntimeError, match=r"Power is not computed by this optimizer's capture.*reads = \[reduction\]"):
        optimizer.step()

    class Declared(Forgot):
        reads = [power]  # noqa: RUF012

    model = net()
    optimizer = InputAwareSGD(model, rules=[Declared()], lr=0.1)
    backward(model, 0)
    optimizer.step()


def test_reading_raw_calls_undeclared_is_refused_naming_the_declaration() -> None:
    class Undeclared(Rule):
        reads = [Power()]  # noqa: RUF012  (statistics only)

        def update(self, optimizer: Any, inputs: Inputs) -> None:
            inputs.get(next(iter(optimizer.param_groups[0]["params"])))

    model = net()
    optimizer = InputAwareSGD(model, rules=[Undeclared()], lr=0.1)
    backward(model, 0)
    with pytest.raises(RuntimeError, match=r"raw calls are not kept.*reads = 'calls'"):
        optimizer.step()

    class Override(InputAwareSGD):
        reads_calls = False

        def step(self, closure: Any = None, inputs: Inputs | None = None) -> Any:
            assert inputs is not None
            inputs.get(next(iter(self.param_groups[0]["params"])))
            return super().step(closure, inputs=inputs)

    model = net()
    optimizer = Override(model, lr=0.1)
    backward(model, 0)
    with pytest.raises(RuntimeError, match=r"reads_calls = True"):
        optimizer.step()


def test_reading_output_gradients_not_asked_for_is_refused_naming_grad_outputs() -> None:
    class Reads(Rule):
        reads = "calls"

        def update(self, optimizer: Any, inputs: Inputs) -> None:
            for module in inputs:
                inputs[module].calls[0].grad_output.pow(2)

    model = net()
    optimizer = InputAwareSGD(model, rules=[Reads()], lr=0.1)
    backward(model, 0)
    with pytest.raises(RuntimeError, match=r"output gradients of Call\(Linear.*grad_outputs = True"):
        optimizer.step()

    class Asks(Reads):
        grad_outputs = True

    model = net()
    optimizer = InputAwareSGD(model, rules=[Asks()], lr=0.1)
    backward(model, 0)
    optimizer.step()


@settings(max_examples=10, deadline=None)
@given(micro_batches=st.integers(1, 4), samples=st.integers(1, 5))
def test_per_sample_statistics_concatenate_over_micro_batches(micro_batches: int, samples: int) -> None:
    class Norms(Reduction):
        combine = Reduction.concatenate

        def forward(self, call: Any) -> torch.Tensor:
            return call.input.norm(dim=-1)

    norms = Norms()
    seen: list[torch.Tensor] = []

    class Reads(Rule):
        reads = [norms]  # noqa: RUF012

        def update(self, optimizer: Any, inputs: Inputs) -> None:
            seen.append(inputs.reduced(norms)[model[0].weight])

    model = net()
    optimizer = InputAwareSGD(model, rules=[Reads()], lr=0.1)
    batches = [batch(i)[:samples] for i in range(micro_batches)]
    for x in batches:
        model(x).sum().backward()
    optimizer.step()
    torch.testing.assert_close(seen[0], torch.cat([x.norm(dim=-1) for x in batches]), rtol=0, atol=0)


def test_a_number_where_params_go_is_refused_saying_params_comes_second() -> None:
    with pytest.raises(TypeError, match=r"the second argument is params.*pass lr=0.01"):
        InputAwareSGD(net(), 0.01)  # type: ignore[arg-type]


def test_the_capture_read_before_it_is_built_names_what_to_do() -> None:
    class Early(InputAwareSGD):
        def __init__(self, model: nn.Module, **kwargs: Any) -> None:
            self.capture.add_reduction(Power())
            super().__init__(model, **kwargs)

    with pytest.raises(RuntimeError, match=r"after super\(\).__init__\(...\) returns, or declare the Reduction"):
        Early(net(), lr=0.1)


def test_a_rule_class_instead_of_an_instance_is_refused() -> None:
    with pytest.raises(TypeError, match=r"pass an instance, TrustRatio\(\)"):
        InputAwareSGD(net(), rules=[TrustRatio], lr=0.1)  # type: ignore[list-item]


@pytest.mark.parametrize("layout", ["beside the base's", "base= rule_state"])
@pytest.mark.parametrize("rule", ["FOOF", "KFAC", "Eva"])
def test_a_checkpoint_of_0_3_loads_the_rules_statistics(rule: str, layout: str) -> None:
    from inputaware_optim import KFAC, Eva

    makers = {"FOOF": FOOF, "KFAC": KFAC, "Eva": Eva}
    base = {} if layout == "beside the base's" else {"base": torch.optim.AdamW}

    def make(model: nn.Module) -> Any:
        return makers[rule](model, lr=0.01, **base)

    whole_model, first_model = net(), net()
    whole, first = make(whole_model), make(first_model)
    for step in range(2):
        backward(whole_model, step)
        whole.step()
        backward(first_model, step)
        first.step()
    saved = copy.deepcopy(first.state_dict())
    for entry in saved["state"].values():  # as 0.3 saved it
        own = entry.pop("rule_state", {"0": {}})["0"]
        if layout == "beside the base's":
            entry.update(own)
        elif own:
            entry["rule_state"] = own
    resumed = make(first_model)
    resumed.load_state_dict(saved)
    assert resumed.rules[0].state.keys() == first.rules[0].state.keys()
    for step in range(2, 4):
        backward(whole_model, step)
        whole.step()
        backward(first_model, step)
        resumed.step()
    assert all(torch.equal(p, q) for p, q in zip(whole_model.parameters(), first_model.parameters(), strict=True))
