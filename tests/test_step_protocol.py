"""The optimizer protocol as torch defines it: step hooks once, one whole state with ``base=``,
copies and pickles that keep everything, closure-driven bases."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from inputaware_optim import DPSGD, FOOF, KFAC, NLMS, Eva, InputAwareAdamW, InputAwareSGD, Inputs


class Rule(InputAwareSGD):
    """A user's rule: halves each gradient, then the stock step through super()."""

    def step(self, closure: Any = None, inputs: Inputs | None = None) -> Any:
        for p in self._params():
            if p.grad is not None:
                p.grad.mul_(0.5)
        return super().step(closure, inputs=inputs)


class DeeperRule(Rule):
    def step(self, closure: Any = None, inputs: Inputs | None = None) -> Any:
        return super().step(closure, inputs=inputs)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def backward(model: nn.Module, step: int) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
    model.zero_grad()
    model(x).pow(2).mean().backward()


@pytest.mark.parametrize("plain_parent", ["none", "before", "after"])
@pytest.mark.parametrize("cls", [InputAwareSGD, Rule, DeeperRule])
def test_step_hooks_run_once_per_step_global_and_per_instance(cls: type, plain_parent: str) -> None:
    def plain_parents() -> None:  # wrapping a parent class's step is what made hooks run twice
        torch.optim.SGD(net().parameters(), lr=0.1)
        InputAwareSGD(net(), lr=0.1)
        Rule(net(), lr=0.1)

    if plain_parent == "before":
        plain_parents()
    model = net()
    optimizer = cls(model, lr=0.1)
    if plain_parent == "after":
        plain_parents()
    seen: list[str] = []
    handles = [
        optimizer.register_step_pre_hook(lambda o, a, k: seen.append("pre")),
        optimizer.register_step_post_hook(lambda o, a, k: seen.append("post")),
        register_optimizer_step_pre_hook(lambda o, a, k: seen.append("global pre")),
        register_optimizer_step_post_hook(lambda o, a, k: seen.append("global post")),
    ]
    try:
        for step in range(2):
            backward(model, step)
            optimizer.step()
    finally:
        for handle in handles:
            handle.remove()
    assert seen == ["global pre", "pre", "post", "global post"] * 2


def test_a_pre_hook_may_inject_inputs_and_they_reach_the_rule() -> None:
    model = net()
    received: list[Any] = []

    class Reader(InputAwareSGD):
        def step(self, closure: Any = None, inputs: Inputs | None = None) -> Any:
            received.append(inputs)
            return super().step(closure, inputs=inputs)

    torch.optim.SGD(net().parameters(), lr=0.1)  # the parent's step wrapped too
    optimizer = Reader(model, lr=0.1)
    backward(model, 0)
    given = optimizer.capture.inputs()
    optimizer.register_step_pre_hook(lambda o, a, k: (a, {**k, "inputs": given}))
    optimizer.step()
    assert received == [given]


def test_inputs_giving_a_weight_another_layers_calls_are_refused_before_any_change() -> None:
    # step(inputs={weight: calls}) took the calls of a module that does not own the weight: the rule
    # normalized the first layer by the last one's inputs, with no word.
    from inputaware_optim import Rule as Transform

    class Normalization(Transform):
        reads = "calls"

        def update(self, optimizer: Any, inputs: Inputs) -> None:
            for p in optimizer._params():
                if p.grad is not None and (seen := inputs.get(p)) is not None:
                    p.grad.div_(1 + seen.cat().pow(2).mean())

    model = nn.ModuleDict({"first": nn.Linear(4, 6), "tied": nn.Linear(4, 6), "last": nn.Linear(6, 3)}).double()
    model.tied.weight = model.first.weight  # a weight two modules own: either one's calls are its inputs
    optimizer = InputAwareSGD(model, rules=[Normalization()], lr=0.1)
    x = torch.randn(5, 4, dtype=torch.float64)
    model.last(torch.tanh(model.first(x) + model.tied(x))).sum().backward()
    inputs = optimizer.capture.inputs()
    weight = model.first.weight
    before = [p.detach().clone() for p in model.parameters()]
    for wrong in ({weight: inputs[model.last]}, {weight: [*inputs[model.first], *inputs[model.last]]}):
        with pytest.raises(TypeError, match=r"gives first\.weight the calls of last \(Linear\), which does not own"):
            optimizer.step(inputs=wrong)
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    optimizer.step(inputs={weight: [*inputs[model.first], *inputs[model.tied]]})  # its owners' calls
    assert not torch.equal(weight, before[0])


# -- base=: one optimizer, one whole state ------------------------------------------------------

RULES: dict[str, Callable[..., Any]] = {
    "InputAwareSGD": lambda m, **kw: InputAwareSGD(m, **kw),
    "Rule": lambda m, **kw: Rule(m, **kw),
    "FOOF": lambda m, **kw: FOOF(m, update_every=2, **kw),
    "KFAC": lambda m, **kw: KFAC(m, update_every=2, **kw),
    "Eva": lambda m, **kw: Eva(m, **kw),
    "NLMS": lambda m, **kw: NLMS(m, **kw),
    "DPSGD": lambda m, **kw: DPSGD(m, max_grad_norm=1.0, noise_multiplier=0.0, **kw),
}
BASES: dict[str, dict[str, Any]] = {
    "own": {"lr": 0.05},
    "AdamW": {"lr": 0.01, "base": torch.optim.AdamW},
}
# The bases whose state-dict hook cases of PyTorch's own optimizer tests failed with base= before.
HOOK_BASES = {
    **BASES,
    "Adam": {"lr": 0.01, "base": torch.optim.Adam},
    "RMSprop": {"lr": 0.01, "base": torch.optim.RMSprop, "momentum": 0.5},
}


def _trained(rule: str, base: str, steps: int = 3) -> tuple[nn.Module, Any]:
    model = net()
    optimizer = RULES[rule](model, **HOOK_BASES[base])
    for step in range(steps):
        backward(model, step)
        optimizer.step()
    return model, optimizer


def _same(a: Any, b: Any, where: Any) -> None:
    """Equal values, tensors compared exactly, through nested dicts and lists (a rule's state, DP's generator)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _same(a[key], b[key], (*where, key))
    elif isinstance(a, (list, tuple)) and not isinstance(b, torch.Tensor):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, (*where, i))
    elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), where
    else:
        assert a == b, where


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert len(a["param_groups"]) == len(b["param_groups"])
    _same(a["param_groups"], b["param_groups"], ("param_groups",))
    _same(a["state"], b["state"], ("state",))


def _step_both(model: nn.Module, optimizer: Any, other_model: nn.Module, other: Any, steps: range) -> None:
    for step in steps:
        backward(model, step)
        optimizer.step()
        backward(other_model, step)
        other.step()
    for p, q in zip(model.parameters(), other_model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copy_holds_the_whole_state_and_steps_as_the_original(rule: str, base: str, how: str) -> None:
    model, optimizer = _trained(rule, base)
    if how == "deepcopy":
        copied_model, copied = copy.deepcopy((model, optimizer))
    elif how == "pickle":
        copied_model, copied = pickle.loads(pickle.dumps((model, optimizer)))
    else:
        buffer = io.BytesIO()
        torch.save((model, optimizer), buffer)
        buffer.seek(0)
        copied_model, copied = torch.load(buffer, weights_only=False)
    assert type(copied).__name__ == type(optimizer).__name__
    _same_state(optimizer.state_dict(), copied.state_dict())
    assert copied.model is copied_model
    _step_both(model, optimizer, copied_model, copied, range(3, 6))


@pytest.mark.parametrize("rule", list(RULES))
def test_a_copy_of_the_optimizer_alone_trains_its_own_copy_of_the_model(rule: str) -> None:
    model, optimizer = _trained(rule, "AdamW")
    copied = copy.deepcopy(optimizer)
    assert copied.model is not model
    assert {id(p) for p in copied.model.parameters()} == {id(p) for g in copied.param_groups for p in g["params"]}
    _step_both(model, optimizer, copied.model, copied, range(3, 5))


@pytest.mark.parametrize("base", list(HOOK_BASES))
@pytest.mark.parametrize("rule", ["InputAwareSGD", "FOOF", "Eva"])
def test_state_dict_hooks_see_the_whole_state(rule: str, base: str) -> None:
    model, optimizer = _trained(rule, base, steps=2)
    whole = optimizer.state_dict()
    calls: list[str] = []

    def pre(opt: Any) -> None:
        calls.append("pre")

    def post(opt: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        calls.append("post")
        _same_state(state_dict, whole)
        state_dict["marker"] = 1
        return state_dict

    optimizer.register_state_dict_pre_hook(pre)
    optimizer.register_state_dict_post_hook(post)
    saved = optimizer.state_dict()
    assert saved["marker"] == 1 and calls == ["pre", "post"]

    def load_pre(opt: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        calls.append("load pre")
        _same_state({**state_dict}, whole)
        return {k: v for k, v in state_dict.items() if k != "marker"}

    def load_post(opt: Any) -> None:
        calls.append("load post")

    resumed_model = copy.deepcopy(model)
    resumed = RULES[rule](resumed_model, **HOOK_BASES[base])
    resumed.register_load_state_dict_pre_hook(load_pre)
    resumed.register_load_state_dict_post_hook(load_post)
    resumed.load_state_dict(copy.deepcopy(saved))  # as from torch.save: torch aliases the tensors it loads
    assert calls[-2:] == ["load pre", "load post"]
    _same_state(resumed.state_dict(), whole)
    _step_both(model, optimizer, resumed_model, resumed, range(2, 4))


def test_lbfgs_as_base_with_a_step_pre_hook_is_lbfgs() -> None:
    def run(make: Callable[[nn.Module], Any], hook: bool) -> float:
        model = net()
        optimizer = make(model)
        if hook:
            optimizer.register_step_pre_hook(lambda o, a, k: None)
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        for _ in range(3):
            optimizer.step(closure)
        return float(closure())

    stock = run(lambda m: torch.optim.LBFGS(m.parameters(), lr=0.5), hook=False)
    for hook in (False, True):
        assert run(lambda m: InputAwareSGD(m, lr=0.5, base=torch.optim.LBFGS), hook) == stock


@pytest.mark.parametrize("rule", ["FOOF", "KFAC", "Eva", "NLMS", "Rule", "DPSGD"])
def test_a_rule_that_changes_gradients_refuses_a_closure_driven_base_by_name(rule: str) -> None:
    with pytest.raises(ValueError, match=r"LBFGS.*closure"):
        RULES[rule](net(), lr=0.5, base=torch.optim.LBFGS)


def test_drop_ins_compose_with_any_base() -> None:
    model = net()
    reference = copy.deepcopy(model)
    optimizer = InputAwareAdamW(model, lr=0.01, base=torch.optim.RMSprop)
    stock = torch.optim.RMSprop(reference.parameters(), lr=0.01)
    for step in range(3):
        backward(model, step)
        backward(reference, step)
        optimizer.step()
        stock.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))


@pytest.mark.parametrize("rule", list(RULES))
def test_parameters_given_where_lr_goes_are_refused_by_name(rule: str) -> None:
    model = net()
    with pytest.raises(TypeError, match=r"got (list|generator) for lr: the parameters are a keyword argument"):
        RULES[rule](model, lr=[{"params": list(model.parameters())}])
    with pytest.raises(TypeError, match=r"got (list|generator) for lr"):
        RULES[rule](model, lr=model.parameters())


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("rule", list(RULES))
def test_a_misspelled_keyword_is_refused_naming_the_class_that_was_called(rule: str, base: str) -> None:
    name = {"Rule": "Rule"}.get(rule, rule)
    with pytest.raises(TypeError, match=rf"^{name}\(\) got an unexpected keyword argument 'dampning'.*it takes: .*lr"):
        RULES[rule](net(), dampning=0.1, **BASES[base])


@pytest.mark.parametrize("cls", [FOOF, KFAC, Eva, NLMS, DPSGD])
def test_param_groups_given_second_as_torch_takes_them_are_refused_by_name(cls: type) -> None:
    model = net()
    with pytest.raises(TypeError, match=rf"{cls.__name__} got list for lr.*{cls.__name__}\(model, params=param_groups"):
        cls(model, [{"params": list(model.parameters())}])


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_model_copied_alone_runs_and_its_copied_hooks_come_off(rule: str, how: str) -> None:
    for model in (nn.Linear(4, 3).double(), net()):  # the root watched itself, or a container
        RULES[rule](model, lr=0.1)
        twin = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
        for _ in range(2):
            twin(torch.randn(5, 4, dtype=torch.float64)).sum().backward()
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in twin.modules()), rule


@pytest.mark.parametrize("rule", ["FOOF", "KFAC", "Eva", "NLMS", "Rule", "InputAwareSGD"])
def test_a_rule_in_front_of_muon_is_muon_fed_the_rules_gradient(rule: str) -> None:
    """torch.optim.Muon (2-D parameters only), at its own defaults: the rule's SGD momentum stays out."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.Tanh(), nn.Linear(6, 3, bias=False)).double()
    reference = copy.deepcopy(model)
    optimizer = RULES[rule](model, lr=0.02, base=torch.optim.Muon)
    stock = torch.optim.Muon(reference.parameters(), lr=0.02)
    for step in range(3):
        backward(model, step)
        backward(reference, step)
        optimizer.step()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            q.grad = p.grad.clone()  # what the rule handed the base
        stock.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))


@pytest.mark.parametrize("rule", list(RULES))
def test_a_lazy_module_sized_at_its_first_call_trains_as_one_built_sized(rule: str) -> None:
    """nn.LazyLinear's weight is an UninitializedParameter until the first forward; a rule built
    before it (as torch.optim allows) updates it exactly as one built on the sized model."""
    torch.manual_seed(0)
    lazy = nn.Sequential(nn.LazyLinear(6), nn.Tanh(), nn.Linear(6, 3)).double()
    sized = copy.deepcopy(lazy)
    torch.manual_seed(1)
    with torch.no_grad():
        sized(torch.zeros(1, 4, dtype=torch.float64))  # sized before its optimizer, from the same draws
    optimizers = [RULES[rule](lazy, lr=0.05), RULES[rule](sized, lr=0.05)]
    torch.manual_seed(1)  # (the lazy one is sized by its first training forward)
    for step in range(3):
        for model, optimizer in zip((lazy, sized), optimizers, strict=True):
            backward(model, step)
            optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(lazy.parameters(), sized.parameters(), strict=True))
    assert optimizers[0].coverage().fallbacks() == []


def test_a_base_refusing_some_parameters_is_reported_with_the_recipe() -> None:
    """Muon takes 2-D parameters only: a rule given the whole model says which ones to pass instead."""
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    with pytest.raises(ValueError, match=r"FOOF\(base=Muon\): Muon refused .*Pass params= only .*2-D weight"):
        FOOF(model, lr=0.02, base=torch.optim.Muon)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("cls", [FOOF, KFAC, Eva, NLMS, DPSGD, InputAwareSGD, InputAwareAdamW])
def test_every_hyperparameter_of_a_rule_is_in_its_signature(cls: type) -> None:
    import inspect

    parameters = inspect.signature(cls).parameters
    assert not any(p.kind is p.VAR_POSITIONAL for p in parameters.values()), cls
    own = {
        "FOOF": {"damping", "stat_decay", "update_every", "statistics_every", "inverse"},
        "KFAC": {"damping", "update_every", "loss_reduction", "convention", "inverse", "inverse_dtype"},
        "Eva": {"damping", "kl_clip", "statistics_every", "damping_form"},
        "NLMS": {"damping"},
        "DPSGD": {"max_grad_norm", "noise_multiplier"},
    }.get(cls.__name__, set())
    assert own <= set(parameters), own - set(parameters)


@pytest.mark.parametrize("cls", [FOOF, KFAC, Eva, NLMS])
def test_rules_that_set_the_step_scale_take_lr_one_way(cls: type) -> None:
    """The preconditioning rules have no default learning rate, and say so alike."""
    with pytest.raises(TypeError, match=rf"^{cls.__name__}\(model, lr=\.\.\.\): the learning rate has no default"):
        cls(net())


def test_state_dict_hooks_of_an_lbfgs_drop_in_see_lbfgs_state() -> None:
    model = net()
    optimizer = InputAwareSGD(model, lr=0.5, base=torch.optim.LBFGS)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    optimizer.step(closure)
    seen: list[set[str]] = []
    optimizer.register_state_dict_post_hook(lambda opt, sd: seen.append(set(sd["state"][0])))
    saved = optimizer.state_dict()
    assert {"d", "t", "old_dirs", "old_stps", "ro", "H_diag", "prev_flat_grad", "prev_loss"} <= seen[0]
    resumed = InputAwareSGD(copy.deepcopy(model), lr=0.5, base=torch.optim.LBFGS)
    loaded: list[Any] = []
    resumed.register_load_state_dict_post_hook(lambda opt: loaded.append(opt._base.state))
    resumed.load_state_dict(copy.deepcopy(saved))
    assert loaded and set(next(iter(loaded[0].values()))) == seen[0]


def test_a_copy_of_an_optimizer_built_with_positional_arguments_and_groups() -> None:
    model = net()
    first, second = model[0], model[2]
    groups = [{"params": first.parameters()}, {"params": second.parameters(), "lr": 0.2}]  # an iterator, spent
    for optimizer in (InputAwareSGD(model, groups, 0.1, 0.9), FOOF(model, 0.1, 0.5, params=groups)):
        copied = copy.deepcopy(optimizer)
        assert [g["lr"] for g in copied.param_groups] == [g["lr"] for g in optimizer.param_groups]
        assert [g["momentum"] for g in copied.param_groups] == [g["momentum"] for g in optimizer.param_groups]
        assert [len(g["params"]) for g in copied.param_groups] == [2, 2]


def test_renamed_names_are_refused_with_the_new_name() -> None:
    model = nn.Linear(3, 2)
    with pytest.raises(TypeError, match="capture_grad_outputs' was renamed: pass grad_outputs="):
        InputAwareAdamW(model, lr=0.1, capture_grad_outputs=True)
    for rule in (KFAC, Eva):
        with pytest.raises(TypeError, match="batch_averaged' was renamed: pass loss_reduction='mean'"):
            rule(model, lr=0.1, batch_averaged=True)
    with pytest.raises(TypeError, match="capture_grad_outputs was renamed: set grad_outputs = True"):

        class Old(InputAwareSGD):
            capture_grad_outputs = True

    for rule in (KFAC, Eva):  # a 0.2 checkpoint's group key is translated, not left beside the new one
        for old, new in ((True, "mean"), (False, "sum")):
            saved = rule(model, lr=0.1).state_dict()
            saved["param_groups"][0].pop("loss_reduction")
            saved["param_groups"][0]["batch_averaged"] = old
            loaded = rule(model, lr=0.1, loss_reduction="sum" if new == "mean" else "mean")
            loaded.load_state_dict(saved)
            assert loaded.param_groups[0]["loss_reduction"] == new
            assert "batch_averaged" not in loaded.param_groups[0]

    seen: list[torch.Tensor] = []

    class Reader(InputAwareSGD):
        def step(self, closure: Any = None, inputs: Inputs | None = None) -> Any:
            assert inputs is not None
            seen.extend(inputs.get(model.weight).grad_outputs())
            return super().step(closure)

    optimizer = Reader(model, lr=0.1, grad_outputs=True)
    (2 * model(torch.randn(4, 3))).sum().backward()
    optimizer.step()
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((4, 2), 2.0))
