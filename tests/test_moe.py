"""Aux-loss-free MoE load balancing: the loads are the tokens each expert got in the step, counted by hand."""

from __future__ import annotations

import copy
import gc
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from inputaware_optim import DPAdamW, InputAwareAdamW, InputAwareSGD, LazyAdamW, LoadBalancing

EXPERTS, TOP_K, DIM = 4, 2, 6


class Router(nn.Module):
    """Top-k over sigmoid scores; the bias steers the choice only (DeepSeek-V3)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.register_buffer("expert_bias", torch.zeros(EXPERTS))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.gate(x).sigmoid()
        indices = (scores + self.expert_bias).topk(TOP_K, dim=-1).indices
        weights = scores.gather(-1, indices)
        return weights / weights.sum(-1, keepdim=True), indices


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = self.router(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            share = (weights * (indices == e)).sum(-1, keepdim=True)  # zero for tokens not routed to e
            out = out + share * expert(x)
        return out


class Net(nn.Module):
    def __init__(self, checkpointing: str = "none") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, DIM)
        self.moe = MoE()
        self.head = nn.Linear(DIM, 1)
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        if self.checkpointing == "none":
            h = self.moe(h)
        else:
            h = checkpoint(self.moe, h, use_reentrant=self.checkpointing == "reentrant")
        return self.head(h)


def data(step: int, tokens: int = 24) -> torch.Tensor:
    return torch.randn(tokens, 3, generator=torch.Generator().manual_seed(step))


@torch.no_grad()
def hand_count(model: Net, x: torch.Tensor) -> torch.Tensor:
    """Tokens per expert, routed with the bias the forward saw."""
    h = torch.tanh(model.embed(x))
    _, indices = model.moe.router(h)
    return torch.bincount(indices.reshape(-1), minlength=EXPERTS).double()


class Seen:
    """A pre-step hook registered after the balancing: the loads it counted."""

    def __init__(self, balancing: LoadBalancing) -> None:
        self.balancing = balancing
        self.loads: list[torch.Tensor] = []

    def __call__(self, optimizer: Any, inputs: Any) -> None:
        assert self.balancing.loads is not None
        router = optimizer.model.moe.router
        self.loads.append(inputs.reduced(self.balancing.loads)[self.balancing.loads.key[router]][router])


def attach(model: Net, optimizer: Any, rate: float = 0.01) -> tuple[LoadBalancing, Seen]:
    balancing = LoadBalancing([model.moe.router], update_rate=rate)
    balancing.attach(optimizer)
    seen = Seen(balancing)
    optimizer.register_inputs_hook(seen, reads=balancing.loads)
    return balancing, seen


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("checkpointing", ["none", "non-reentrant", "reentrant"])
@pytest.mark.parametrize("micro_batches", [1, 3])
@pytest.mark.filterwarnings("ignore:LazyAdamW found no nn.Embedding")
@pytest.mark.parametrize("rule", [InputAwareAdamW, LazyAdamW])  # (LazyAdamW watches only embeddings itself)
def test_loads_are_the_tokens_each_expert_got_in_the_step(checkpointing: str, micro_batches: int, rule: Any) -> None:
    model = Net(checkpointing)
    optimizer = rule(model, lr=0.01)
    _, seen = attach(model, optimizer)
    for step in range(3):
        optimizer.zero_grad()
        expected = torch.zeros(EXPERTS, dtype=torch.float64)
        for micro in range(micro_batches):
            x = data(10 * step + micro)
            expected += hand_count(model, x)
            model(x).pow(2).mean().backward()
        with torch.no_grad():
            model(data(99))  # an evaluation forward in between counts for nothing
        model(data(98)).sum()  # nor does a forward that never reaches a backward
        optimizer.step()
        torch.testing.assert_close(seen.loads[-1], expected, rtol=0, atol=0)


def test_the_bias_moves_by_the_papers_rule_and_balances_the_loads() -> None:
    model = Net()
    optimizer = InputAwareSGD(model, lr=0.0)  # the routing changes by the bias alone
    rate = 0.005
    balancing, _ = attach(model, optimizer, rate)
    x = data(0, tokens=256)
    spread = []
    for _ in range(150):
        optimizer.zero_grad()
        before = model.moe.router.expert_bias.clone()
        load = hand_count(model, x)
        spread.append(float(load.max() - load.min()))
        model(x).pow(2).mean().backward()
        optimizer.step()
        expected = before + rate * torch.sign(load.mean() - load).float()
        torch.testing.assert_close(model.moe.router.expert_bias, expected, rtol=0, atol=0)
    assert spread[0] > 100 and max(spread[-10:]) <= spread[0] / 5, spread  # balanced by the bias alone
    assert balancing.update_rate == rate


def test_the_update_rate_is_read_at_each_step() -> None:
    model = Net()
    optimizer = InputAwareSGD(model, lr=0.0)
    balancing, _ = attach(model, optimizer, 0.01)
    balancing.update_rate = 0.0
    model(data(0)).pow(2).mean().backward()
    optimizer.step()
    assert not model.moe.router.expert_bias.any()
    for bad in (-0.01, float("nan"), "0.1"):  # a negative rate would unbalance, silently
        with pytest.raises(ValueError, match="Invalid update_rate"):
            balancing.update_rate = bad  # type: ignore[assignment]
    assert balancing.update_rate == 0.0


def test_refusals_name_the_router_and_change_nothing() -> None:
    model = Net()
    with pytest.raises(ValueError, match="no expert bias 'missing'"):
        LoadBalancing([model.moe.router], bias="missing")
    optimizer = InputAwareSGD(model, lr=0.1, params=model.head.parameters())
    with pytest.raises(ValueError, match=r"moe\.router owns no parameter the optimizer trains"):
        LoadBalancing([model.moe.router]).attach(optimizer)
    model.moe.router.expert_bias = nn.Parameter(torch.zeros(EXPERTS))
    optimizer = InputAwareSGD(model, lr=0.1)
    with pytest.raises(ValueError, match=r"expert bias of moe\.router is trained"):
        LoadBalancing([model.moe.router]).attach(optimizer)


def test_balancing_under_dp_is_refused_the_loads_are_not_private() -> None:
    model = Net()
    optimizer = DPAdamW(model, lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"LoadBalancing on DPAdamW: .* token counts of each batch, which no clipping"):
        LoadBalancing([model.moe.router]).attach(optimizer)


def test_a_router_gradient_no_captured_call_explains_is_refused_before_any_change() -> None:
    model = Net()
    optimizer = InputAwareSGD(model, lr=0.1)
    attach(model, optimizer)
    h = torch.tanh(model.embed(data(0)))
    (h @ model.moe.router.gate.weight.T).sum().backward()  # the gate's weight used without calling it
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match=r"moe\.router got gradient from no captured call"):
        optimizer.step()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def _ddp_worker(rank: int) -> None:
    model = DistributedDataParallel(Net())
    optimizer = InputAwareSGD(model, lr=0.0)
    balancing = LoadBalancing([model.module.moe.router], update_rate=0.01)
    balancing.attach(optimizer)
    whole = torch.cat([data(0), data(1)])
    expected = hand_count(model.module, whole)  # both ranks' tokens
    model(data(rank)).pow(2).mean().backward()
    optimizer.step()
    bias = model.module.moe.router.expert_bias
    torch.testing.assert_close(bias, 0.01 * torch.sign(expected.mean() - expected).float(), rtol=0, atol=0)
    gathered = [torch.zeros_like(bias) for _ in range(2)]
    dist.all_gather(gathered, bias)
    assert torch.equal(gathered[0], gathered[1])


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_under_ddp_the_loads_are_summed_over_the_ranks() -> None:
    from .test_distributed import run_two_processes

    run_two_processes(_ddp_worker)


# -- what the router returned -------------------------------------------------------------------------------------


class MaskRouter(Router):
    """Returns ``(weights, mask, indices)``: the bool mask comes first."""

    def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
        weights, indices = super().forward(x)
        mask = torch.zeros(len(x), EXPERTS, dtype=torch.bool).scatter_(1, indices, True)
        return weights, mask, indices


class Routed(nn.Module):
    def __init__(self, router: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = router

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(x)[0].pow(2).sum()


def test_the_default_selection_is_the_first_integer_tensor_not_a_bool_mask() -> None:
    model = Routed(MaskRouter())
    optimizer = InputAwareSGD(model, lr=0.0)
    LoadBalancing([model.router], update_rate=0.01).attach(optimizer)
    x = torch.randn(32, DIM, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        load = torch.bincount(model.router(x)[2].reshape(-1), minlength=EXPERTS).double()
    model(x).backward()
    optimizer.step()
    assert torch.equal(model.router.expert_bias, 0.01 * torch.sign(load.mean() - load).float())


class ScoresOnly(Router):
    def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
        weights, indices = super().forward(x)
        return weights, indices > 1  # no integer tensor: weights and a bool mask


@pytest.mark.parametrize(
    ("router", "selected"),
    [(ScoresOnly, None), (Router, lambda call: call.output[0]), (Router, lambda call: call.output[1] + EXPERTS)],
    ids=["no integer tensor", "floating", "out of range"],
)
def test_an_unusable_selection_is_an_error_naming_selected(router: type[nn.Module], selected: Any) -> None:
    model = Routed(router())
    optimizer = InputAwareSGD(model, lr=0.1)
    LoadBalancing([model.router], update_rate=0.01, selected=selected).attach(optimizer)
    model(torch.randn(8, DIM)).backward()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises((TypeError, ValueError), match=r"selected="):
        optimizer.step()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


# -- routers sharing one gate -------------------------------------------------------------------------------------


class SharedGate(nn.Module):
    """Two routers, one gate: the second routes the first half of the tokens, negated."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, DIM)
        self.first, self.second = Router(), Router()
        self.second.gate = self.first.gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = self.routed(torch.tanh(self.embed(x)))
        return first[0].pow(2).sum() + second[0].pow(2).sum()

    def routed(self, h: torch.Tensor) -> tuple[Any, Any]:
        return self.first(h), self.second(-h[: len(h) // 2])


def test_routers_sharing_a_gate_count_their_own_calls() -> None:
    # Both were given the sum of their loads ([9, 2, 21, 16] and [24, 24, 0, 0] became [33, 26, 21, 16]).
    model = SharedGate()
    optimizer = InputAwareSGD(model, lr=0.0)
    routers = [model.first, model.second]
    balancing = LoadBalancing(routers, update_rate=0.01)
    balancing.attach(optimizer)
    seen: list[Any] = []
    optimizer.register_inputs_hook(
        lambda _, inputs: seen.append(inputs.reduced(balancing.loads)), reads=balancing.loads
    )
    x = data(0, tokens=48)
    with torch.no_grad():
        expected = [
            torch.bincount(i.reshape(-1), minlength=EXPERTS).double() for _, i in model.routed(model.embed(x).tanh())
        ]
    assert not torch.equal(expected[0], expected[1])
    model(x).backward()
    optimizer.step()
    for router, load in zip(routers, expected, strict=True):
        assert torch.equal(router.expert_bias, 0.01 * torch.sign(load.mean() - load).float())
    assert balancing.loads is not None
    for router, load in zip(routers, expected, strict=True):
        torch.testing.assert_close(seen[-1][balancing.loads.key[router]][router], load, rtol=0, atol=0)


# -- a gate frozen after attach -----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["requires_grad", "removed from the optimizer"])
def test_a_gate_frozen_after_attach_is_refused_before_any_change(how: str) -> None:
    model = Net()
    optimizer = InputAwareSGD(model, lr=0.1)
    attach(model, optimizer)
    gate = model.moe.router.gate.weight
    if how == "requires_grad":
        gate.requires_grad_(False)
    else:
        group = optimizer.param_groups[0]
        group["params"] = [p for p in group["params"] if p is not gate]
    optimizer.zero_grad()
    model(data(0)).pow(2).mean().backward()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(
        RuntimeError, match=r"moe\.router \(moe\.router\.gate\.weight no longer trains\): requires_grad is False"
    ):
        optimizer.step()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


# -- conditional compute under DDP --------------------------------------------------------------------------------


class SometimesSkips(Net):
    """A batch that skips the MoE block (conditional compute): the router gets its gradient from DDP alone."""

    def __init__(self, skips: bool) -> None:
        super().__init__()
        self.skips = skips

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x))) if self.skips else super().forward(x)


def _ddp_skipping_worker(rank: int) -> None:
    model = DistributedDataParallel(SometimesSkips(skips=rank == 1), find_unused_parameters=True)
    optimizer = InputAwareSGD(model, lr=0.0)
    LoadBalancing([model.module.moe.router], update_rate=0.01).attach(optimizer)
    expected = hand_count(model.module, data(0))  # rank 0's tokens, the only ones routed
    model(data(rank)).pow(2).mean().backward()
    assert model.module.moe.router.gate.weight.grad is not None  # from DDP's all-reduce on rank 1
    optimizer.step()
    bias = model.module.moe.router.expert_bias
    torch.testing.assert_close(bias, 0.01 * torch.sign(expected.mean() - expected).float(), rtol=0, atol=0)
    gathered = [torch.zeros_like(bias) for _ in range(2)]
    dist.all_gather(gathered, bias)
    assert torch.equal(gathered[0], gathered[1])


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_under_ddp_a_rank_whose_batch_skips_the_block_joins_with_zeros() -> None:
    # It raised "got gradient from no captured call" (the gradient came from DDP's all-reduce), and the
    # other rank died in the collective.
    from .test_distributed import run_two_processes

    run_two_processes(_ddp_skipping_worker)


# -- bfloat16 biases: moved in float32, written back rounded ------------------------------------------------------


def paper_step(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """``b_i + u * sign(mean(c) - c_i)`` in float32, from a float64 hand count."""
    return bias.float() + rate * torch.sign(load.mean() - load).float()


def test_a_bfloat16_bias_moves_by_a_float32_master_copy() -> None:
    # Updates of 1e-3 round away on a bfloat16 bias with |b| >= 0.5: from -0.6, 200 steps left it where it
    # was and the loads at [126, 13, 178, 195] (float32: [127, 130, 127, 128]).
    model = Net()
    optimizer = InputAwareSGD(model, lr=0.0)  # the routing changes by the bias alone
    rate = 1e-3
    attach(model, optimizer, rate)
    model.to(torch.bfloat16)  # after attach: the buffer's dtype is read at the step
    router = model.moe.router
    router.expert_bias.fill_(-0.6)
    master = router.expert_bias.float()
    x = data(0, tokens=256).bfloat16()
    first = hand_count(model, x)
    for _ in range(200):
        optimizer.zero_grad()
        load = hand_count(model, x)
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        master = paper_step(master, load, rate)
        assert router.expert_bias.dtype == torch.bfloat16
        assert torch.equal(router.expert_bias, master.to(torch.bfloat16))
    last = hand_count(model, x)
    assert float(first.max() - first.min()) > 100 and float(last.max() - last.min()) <= 20, (first, last)
    model.to(torch.float64)  # cast again: the bias holds the bfloat16 value now, and moves in float64 from it
    before, load = router.expert_bias.clone(), hand_count(model, x.double())
    model(x.double()).pow(2).mean().backward()
    optimizer.step()
    assert router.expert_bias.dtype == torch.float64
    assert torch.equal(router.expert_bias, before + rate * torch.sign(load.mean() - load))


def test_a_resumed_bfloat16_run_moves_the_biases_bitwise() -> None:
    def run(steps: range, resume: dict[str, Any] | None) -> tuple[Net, Any, LoadBalancing]:
        model = Net().to(torch.bfloat16)
        optimizer = InputAwareSGD(model, lr=0.01)
        balancing, _ = attach(model, optimizer, 1e-3)
        if resume is None:
            model.moe.router.expert_bias.fill_(-0.6)
        else:
            model.load_state_dict(resume["model"])
            optimizer.load_state_dict(resume["optimizer"])
            balancing.load_state_dict(resume["balancing"])
        for step in steps:
            optimizer.zero_grad()
            model(data(step, tokens=64).bfloat16()).float().pow(2).mean().backward()
            optimizer.step()
        return model, optimizer, balancing

    whole, _, _ = run(range(40), None)
    model, optimizer, balancing = run(range(20), None)
    saved = copy.deepcopy(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "balancing": balancing.state_dict()}
    )
    resumed, _, _ = run(range(20, 40), saved)
    assert not torch.equal(whole.moe.router.expert_bias, saved["model"]["moe.router.expert_bias"])
    assert torch.equal(resumed.moe.router.expert_bias, whole.moe.router.expert_bias)
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), whole.parameters(), strict=True))


def test_a_bias_set_from_outside_is_the_one_moved() -> None:
    # The master copy must not overwrite a bias loaded or set since the last step.
    model = Net().to(torch.bfloat16)
    optimizer = InputAwareSGD(model, lr=0.0)
    attach(model, optimizer, 1e-3)
    x = data(0).bfloat16()
    for bias in (None, 0.25, -0.75):
        if bias is not None:
            model.moe.router.expert_bias.fill_(bias)
        before = model.moe.router.expert_bias.clone()
        load = hand_count(model, x)
        optimizer.zero_grad()
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        assert torch.equal(model.moe.router.expert_bias, paper_step(before, load, 1e-3).to(torch.bfloat16))


def test_load_state_dict_checks_what_it_is_given() -> None:
    model = Net()
    balancing = LoadBalancing([model.moe.router])
    for bad in ({}, {"master_bias": []}, {"master_bias": [torch.zeros(EXPERTS + 1)]}, {"master_bias": ["x"]}):
        with pytest.raises(ValueError, match=r"LoadBalancing\.load_state_dict"):
            balancing.load_state_dict(bad)
    assert balancing.state_dict() == {"master_bias": [None]}


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle"])
def test_a_copy_of_an_attached_balancing_is_refused_naming_what_to_do(how: str) -> None:
    # deepcopy((model, optimizer, balancing, monitor)) gave a balancing and a monitor attached to nothing: the
    # copied optimizer is built anew, without their hooks, so the copy's biases never moved, with no word.
    from inputaware_optim import Monitor

    copier = {
        "deepcopy": copy.deepcopy,
        "copy": copy.copy,
        "pickle": lambda x: pickle.loads(pickle.dumps(x)),
    }[how]
    model = Net()
    optimizer = InputAwareSGD(model, lr=0.05)
    balancing = LoadBalancing([model.moe.router], update_rate=0.01)
    copier(balancing)  # attached to nothing yet: a copy is fine
    balancing.attach(optimizer)
    monitor = Monitor(optimizer)
    for step in range(2):
        optimizer.zero_grad()
        model(data(step)).pow(2).mean().backward()
        optimizer.step()
    with pytest.raises(TypeError, match=r"LoadBalancing attached to an optimizer cannot be copied.*attach a new"):
        copier((model, optimizer, balancing, monitor) if how != "copy" else balancing)  # (copy.copy shares items)
    with pytest.raises(TypeError, match=r"Monitor attached to an optimizer cannot be copied.*attach a new Monitor"):
        copier((model, optimizer, monitor) if how != "copy" else monitor)
    # What the error says to do: copy the model and optimizer (with the tools attached, that works), attach anew.
    copied_model, copied = copy.deepcopy((model, optimizer))
    again = LoadBalancing([copied_model.moe.router], update_rate=0.01)
    again.load_state_dict(balancing.state_dict())
    again.attach(copied)
    for m, o in ((model, optimizer), (copied_model, copied)):
        o.zero_grad()
        m(data(2)).pow(2).mean().backward()
        o.step()
    assert torch.equal(copied_model.moe.router.expert_bias, model.moe.router.expert_bias)
    assert model.moe.router.expert_bias.any()
    monitor.remove()
    del optimizer, monitor
    gc.collect()
    copier(balancing)  # its optimizer is gone: attached to nothing again
