"""The group a rule combines statistics over is resolved when it is read, never frozen silently."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from inputaware_optim import FOOF, InputAwareSGD

from .test_distributed import run_two_processes

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    optimizer.zero_grad()
    model(torch.full((2, 3), float(rank + 1))).pow(2).sum().backward()
    optimizer.step()


def worker(rank: int) -> None:
    torch.manual_seed(0)
    # FOOF built on the bare model, which is wrapped in DDP only afterwards: its statistics
    # would stay per rank and the replicas drift apart. The step refuses by name and changes nothing.
    bare = nn.Linear(3, 2)
    foof = FOOF(bare, lr=0.1)
    model = DistributedDataParallel(bare)
    before = [p.detach().clone() for p in bare.parameters()]
    with pytest.raises(RuntimeError, match=r"not wrapped in DistributedDataParallel.*process_group="):
        _step(model, foof, rank)
    assert all(torch.equal(p, q) for p, q in zip(bare.parameters(), before, strict=True))

    # Told the group, it works, and the replicas agree.
    foof = FOOF(bare, lr=0.1, process_group=dist.group.WORLD)
    for _ in range(2):
        _step(model, foof, rank)
    for p in bare.parameters():
        gathered = [torch.empty_like(p) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, p.detach())
        assert all(torch.equal(gathered[0], g) for g in gathered)

    # process_group=None: each rank keeps its own statistics, deliberately; the plain drop-in never asks.
    assert FOOF(nn.Linear(3, 2), lr=0.1, process_group=None).data_parallel_group is None
    plain = nn.Linear(3, 2)
    _step(plain, InputAwareSGD(plain, lr=0.1), rank)


@pytest.mark.slow
def test_a_rule_built_before_ddp_refuses_and_an_explicit_group_works() -> None:
    run_two_processes(worker)
