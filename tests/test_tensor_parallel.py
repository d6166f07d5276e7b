"""Tensor parallelism (``parallelize_module``) on 2 gloo processes, and FSDP2 x tensor parallelism on a (2, 2) mesh
of 4: every rule matches the unsharded model trained in one process on the whole batch (float64), or refuses by
name, naming tensor parallelism and the layer, before anything changed."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from inputaware_optim import (
    DPSGD,
    FOOF,
    KFAC,
    NLMS,
    DPAdamW,
    Eva,
    InputAwareAdamW,
    InputAwareSGD,
    LazyAdamW,
    WhitenedMuon,
)

from .multiprocess import mark_done, run_spawned

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

STEPS = 3
BATCH = 4  # global: tensor parallelism hands every rank all of it, FSDP2 each data-parallel rank half
POSITIONS = 6  # split over the ranks by SequenceParallel
VOCAB = 40


class Net(nn.Module):
    """A vocabulary-sharded embedding, a sequence-parallel norm, a column-sharded then a row-sharded Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 12)
        self.down = nn.Linear(12, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(self.norm(self.embed(tokens))))).mean(1)


def plan(**down: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        # (its output a replicated DTensor, which SequenceParallel splits along the positions)
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=False),
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(**down),
    }


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, POSITIONS), generator=generator),
            torch.randn(BATCH, 3, generator=generator, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def loss_of(model: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (model(tokens) - target).pow(2).sum(1).mean()


def _but_down(model: nn.Module) -> list[nn.Parameter]:
    """The parameters FOOF preconditions or steps (``down``, row-sharded, is refused by it: trained by none)."""
    return [p for name, p in model.named_parameters() if not name.startswith("down")]


# Each maker takes the model and the samples one rank's step averages over (DP's expected_batch_size).
RULES: dict[str, Callable[..., Any]] = {
    "InputAwareSGD": lambda m, b, **kw: InputAwareSGD(m, **kw, lr=0.1, momentum=0.9),
    "InputAwareAdamW": lambda m, b, **kw: InputAwareAdamW(m, **kw, lr=0.01),
    "NLMS": lambda m, b, **kw: NLMS(m, **kw, lr=0.1),
    "FOOF": lambda m, b, **kw: FOOF(m, **kw, lr=0.05, update_every=2, params=_but_down(m)),
    "FOOF-shared": lambda m, b, **kw: FOOF(
        m, **kw, lr=0.05, update_every=2, distributed_inversion=True, params=_but_down(m)
    ),
    "LazyAdamW": lambda m, b, **kw: LazyAdamW(m, **kw, lr=0.01),
    "DPSGD": lambda m, b, **kw: DPSGD(m, **kw, lr=0.5, max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=b),
    "DPAdamW": lambda m, b, **kw: DPAdamW(
        m, **kw, lr=0.01, max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=b
    ),
    # The noise drawn once, in full, from the same generator as one process draws it: the same bits.
    "DPSGD-noise": lambda m, b, **kw: DPSGD(
        m,
        **kw,
        lr=0.5,
        max_grad_norm=0.1,
        noise_multiplier=1.0,
        expected_batch_size=b,
        generator=torch.Generator().manual_seed(7 + dist.get_rank()),  # (shared from the group's first rank)
    ),
}

# Refused at construction, naming tensor parallelism and the layer.
REFUSED: dict[str, tuple[Callable[[nn.Module], Any], str]] = {
    "FOOF": (lambda m: FOOF(m, lr=0.05), "FOOF cannot precondition down under tensor parallelism: RowwiseParallel"),
    "KFAC": (lambda m: KFAC(m, lr=0.05), "KFAC cannot precondition up under tensor parallelism: ColwiseParallel"),
    "KFAC-kfac-pytorch": (
        lambda m: KFAC(m, lr=0.05, convention="kfac-pytorch"),
        "KFAC cannot precondition up under tensor parallelism: ColwiseParallel",
    ),
    "Eva": (lambda m: Eva(m, lr=0.05), "Eva cannot precondition up under tensor parallelism: ColwiseParallel"),
    "WhitenedMuon": (
        lambda m: WhitenedMuon(m, lr=0.05),
        "WhitenedMuon cannot precondition up under tensor parallelism: ColwiseParallel .* the polar factor couples",
    ),
}


def train_whole(rule: str) -> list[torch.Tensor]:
    """One process on the whole batch, the model unsharded, in float64: the reference."""
    model = Net().double()
    kwargs = {"process_group": None}
    if rule == "DPSGD-noise":
        kwargs["generator"] = torch.Generator().manual_seed(7)
        optimizer = DPSGD(model, lr=0.5, max_grad_norm=0.1, noise_multiplier=1.0, expected_batch_size=BATCH, **kwargs)
    else:
        optimizer = RULES[rule](model, BATCH, **kwargs)
    for tokens, target in batches():
        optimizer.zero_grad()
        loss_of(model, tokens, target).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def train(rule: str, model: nn.Module, part: slice, samples: int) -> Any:
    optimizer = RULES[rule](model, samples)
    for tokens, target in batches():
        optimizer.zero_grad()
        loss_of(model, tokens[part], target[part]).backward()
        optimizer.step()
    return optimizer


def assert_matches_one_process(model: nn.Module, rule: str) -> None:
    full = [p.full_tensor() for p in model.parameters()]  # type: ignore[attr-defined]
    for (name, _), p, q in zip(model.named_parameters(), full, train_whole(rule), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=f"{rule}: {name}")


def snapshot(model: nn.Module, optimizer: Any = None) -> list[torch.Tensor]:
    """The parameters (each rank's shard) and the optimizer's state tensors, copied."""
    tensors = [p.detach() for p in model.parameters()]
    if optimizer is not None:
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        tensors += state + [v for r in optimizer.rules for s in r.state.values() for v in s.values()]
    return [(t.to_local() if hasattr(t, "to_local") else t).clone() for t in tensors]


def assert_unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def assert_refusals(make_model: Callable[[], nn.Module]) -> None:
    for rule, (make, message) in REFUSED.items():
        model = make_model()
        before = snapshot(model)
        with pytest.raises(NotImplementedError, match=message) as refused:
            make(model)
        assert "tensor parallelism" in str(refused.value), rule
        assert_unchanged(before, snapshot(model))


def tensor_parallel_worker(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2,))

    def parallel() -> nn.Module:
        return parallelize_module(Net().double(), mesh, plan())

    everything = slice(None)  # every rank of a tensor-parallel group sees the whole batch
    for rule in RULES:
        model = parallel()
        optimizer = train(rule, model, everything, BATCH)
        assert_matches_one_process(model, rule)
        if rule == "LazyAdamW":  # the table's rows no step touched kept their moments at zero, on every rank
            moments = optimizer.state[model.embed.weight]["exp_avg"].full_tensor()
            touched = torch.unique(torch.cat([tokens.reshape(-1) for tokens, _ in batches()]))
            untouched = torch.ones(VOCAB, dtype=torch.bool)
            untouched[touched] = False
            assert bool(untouched.any()) and not bool(moments[untouched].any())
    assert_refusals(parallel)
    # An embedding split on its features (ColwiseParallel), then a row-sharded Linear: the touched rows' features.
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def lookup(parallel: bool) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 3)).double()
        return parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()}) if parallel else model

    for rule in ("LazyAdamW", "DPSGD", "NLMS"):
        trained = []
        for parallel in (True, False):
            model = lookup(parallel)
            optimizer = RULES[rule](model, BATCH, **({} if parallel else {"process_group": None}))
            for tokens, target in batches():
                optimizer.zero_grad()
                loss_of(lambda t: model(t).mean(1), tokens, target).backward()  # noqa: B023
                optimizer.step()
            trained.append([p.full_tensor() if parallel else p.detach() for p in model.parameters()])  # type: ignore[operator]
        for p, q in zip(*trained, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=f"{rule} on a ColwiseParallel embedding")
    # A row-sharded Linear whose output is scattered along the positions: DP's per-sample gradients need every
    # position of a sample on one rank; refused at the step, naming the layer, with nothing changed.
    from torch.distributed.tensor import Shard

    model = parallelize_module(Net().double(), mesh, plan(output_layouts=Shard(1)))
    optimizer = RULES["DPSGD"](model, BATCH)
    tokens, target = batches()[0]
    loss_of(model, tokens, target).backward()
    before = snapshot(model, optimizer)
    with pytest.raises(RuntimeError, match="under tensor parallelism the output gradient of down"):
        optimizer.step()
    assert_unchanged(before, snapshot(model, optimizer))


def two_linears_worker(rank: int) -> None:
    """Issue 43's own reproduction: a column-sharded then a row-sharded Linear, ``process_group=None``. NLMS
    crashed (a DTensor statistic times a local gradient), DPSGD took the batch for ``0.weight`` (a DTensor's
    data_ptr() is 0, as every one's: a batch of 8 inputs of 4 has the weight's shape), FOOF and K-FAC named FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(STEPS, 8, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def net(parallel: bool) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}) if parallel else model

    makers: dict[str, Callable[[nn.Module], Any]] = {
        "NLMS": lambda m: NLMS(m, lr=0.1, process_group=None),
        "DPSGD": lambda m: DPSGD(m, lr=0.5, max_grad_norm=0.1, noise_multiplier=0.0, process_group=None),
        "InputAwareAdamW": lambda m: InputAwareAdamW(m, lr=0.01, process_group=None),
    }
    for rule, make in makers.items():
        trained = []
        for parallel in (True, False):
            model = net(parallel)
            optimizer = make(model)
            for batch in x:
                optimizer.zero_grad()
                model(batch).pow(2).sum(1).mean().backward()
                optimizer.step()
            trained.append([p.full_tensor() if parallel else p.detach() for p in model.parameters()])  # type: ignore[operator]
        for p, q in zip(*trained, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=rule)
    for make, message in (
        (lambda m: FOOF(m, lr=0.1, process_group=None), "FOOF cannot precondition 2 under tensor parallelism"),
        (lambda m: KFAC(m, lr=0.1, process_group=None), "KFAC cannot precondition 0 under tensor parallelism"),
        (lambda m: Eva(m, lr=0.1, process_group=None), "Eva cannot precondition 0 under tensor parallelism"),
    ):
        with pytest.raises(NotImplementedError, match=message):
            make(net(True))


def fsdp_tensor_parallel_worker(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))

    def parallel() -> nn.Module:
        model = parallelize_module(Net().double(), mesh["tensor"], plan())
        for layer in (model.embed, model.norm, model.up, model.down):
            fully_shard(layer, mesh=mesh["data"])
        return fully_shard(model, mesh=mesh["data"])

    local = BATCH // 2
    index = mesh.get_local_rank("data")
    part = slice(index * local, (index + 1) * local)  # each data-parallel rank half the batch
    for rule in RULES:
        model = parallel()
        train(rule, model, part, local)
        assert_matches_one_process(model, rule)
    assert_refusals(parallel)


def _entry(rank: int, directory: str, port: int, worker: Callable[[int], None], world: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    worker(rank)
    dist.barrier()  # no rank leaves while another still uses the group
    mark_done(directory, rank)
    os._exit(0)  # (torch 2.13's gloo teardown may abort a finished rank: see tests/multiprocess.py)


def run_processes(worker: Callable[[int], None], world: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_spawned(_entry, args=(port, worker, world), world=world, timeout=600)


@pytest.mark.slow
def test_every_rule_under_tensor_parallelism_matches_one_process_or_refuses_by_name() -> None:
    run_processes(tensor_parallel_worker, 2)


@pytest.mark.slow
def test_issue_reproduction_two_linears_is_exact_or_refused_by_name() -> None:
    run_processes(two_linears_worker, 2)


@pytest.mark.slow
def test_every_rule_under_fsdp2_and_tensor_parallelism_matches_one_process_or_refuses_by_name() -> None:
    run_processes(fsdp_tensor_parallel_worker, 4)
