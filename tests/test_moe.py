"""Aux-loss-free MoE load balancing: the loads are the tokens each expert got in the step, counted by hand."""

from __future__ import annotations

import copy
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
        self.loads.append(inputs.reduced(self.balancing.loads)[self.balancing.loads.key[optimizer.model.moe.router]])


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
