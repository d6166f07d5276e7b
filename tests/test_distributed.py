"""Two gloo processes: DDP and FSDP2 keep replicas identical and match one process on the whole batch."""

from __future__ import annotations

import math
import os
import socket
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

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

WORLD = 2
STEPS = 3
BATCH = 8  # global; each rank takes half


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(40, 6)
        self.hidden = nn.Linear(6, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(tokens)))).mean(1)


class Gain(nn.Module):
    """A layer no registered kind describes (its per-sample gradients: torch.func, on the whole weight)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight.exp()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 40, (BATCH, 5), generator=generator), torch.randn(BATCH, 3, generator=generator))
        for _ in range(STEPS)
    ]


def loss_of(model: nn.Module, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (model(tokens) - target).pow(2).sum(1).mean()


def _linear_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()]


# Each maker takes the model and the samples one step of one process averages over (DP's
# expected_batch_size: under accumulation the micro-batches of a step cannot tell it otherwise).
RULES: dict[str, Callable[..., Any]] = {
    "InputAwareSGD": lambda m, b, **kw: InputAwareSGD(m, **kw, lr=0.1, momentum=0.9),
    "InputAwareAdamW": lambda m, b, **kw: InputAwareAdamW(m, **kw, lr=0.01),
    "FOOF": lambda m, b, **kw: FOOF(m, **kw, lr=0.05, update_every=2),
    "KFAC": lambda m, b, **kw: KFAC(m, **kw, lr=0.05, update_every=2, damping=1e-2),
    "NLMS": lambda m, b, **kw: NLMS(m, **kw, lr=0.1),
    "LazyAdamW": lambda m, b, **kw: LazyAdamW(m, **kw, lr=0.01),
    "DPSGD": lambda m, b, **kw: DPSGD(m, **kw, lr=0.5, max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=b),
    "DPSGD-noise": lambda m, b, **kw: DPSGD(
        m, **kw, lr=0.5, max_grad_norm=0.1, noise_multiplier=1.0, expected_batch_size=b
    ),
    "DPAdamW": lambda m, b, **kw: DPAdamW(
        m, **kw, lr=0.01, max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=b
    ),
    "FOOF-shared": lambda m, b, **kw: FOOF(m, **kw, lr=0.05, update_every=2, distributed_inversion=True),
    # (the Linear layers' parameters: the embedding is not a layer it whitens, and takes no optimizer here)
    "WhitenedMuon": lambda m, b, **kw: WhitenedMuon(m, **kw, lr=0.02, update_every=2, params=_linear_params(m)),
    "WhitenedMuon-shared": lambda m, b, **kw: WhitenedMuon(
        m, **kw, lr=0.02, update_every=2, params=_linear_params(m), distributed_inversion=True
    ),
    "KFAC-shared": lambda m, b, **kw: KFAC(m, **kw, lr=0.05, update_every=2, damping=1e-2, distributed_inversion=True),
}


def train_whole(rule: str, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """One process on the whole batch: the reference."""
    model = Net().to(dtype)
    optimizer = RULES[rule](model, BATCH, process_group=None)  # one process's whole batch
    for tokens, target in batches():
        optimizer.zero_grad()
        loss_of(model, tokens, target.to(dtype)).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def assert_replicas_identical(params: list[torch.Tensor]) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    for other in gathered[1:]:
        assert torch.equal(gathered[0], other), "replicas diverged"


def ddp_worker(rank: int) -> None:
    part = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    for rule in RULES:
        for micro_batches in (1, 2):
            model = DistributedDataParallel(Net())
            optimizer = RULES[rule](model, BATCH // WORLD)
            for tokens, target in batches():
                optimizer.zero_grad()
                local_tokens, local_target = tokens[part], target[part]
                size = len(local_tokens) // micro_batches
                for k in range(micro_batches):
                    chunk = slice(k * size, (k + 1) * size)
                    last = k == micro_batches - 1
                    with model.no_sync() if not last else torch.enable_grad():
                        (loss_of(model, local_tokens[chunk], local_target[chunk]) / micro_batches).backward()
                if rule == "LazyAdamW":  # each rank saw the rows of its own half of the batch
                    rows = optimizer.capture.reduced(optimizer._rows)[model.module.embed.weight]
                    assert torch.equal(rows, torch.unique(local_tokens)), (rows, local_tokens)
                optimizer.step()
            assert_replicas_identical(list(model.parameters()))
            if rank == 0 and rule != "DPSGD-noise":
                for p, q in zip(model.parameters(), train_whole(rule), strict=True):
                    torch.testing.assert_close(p.detach(), q, rtol=1e-4, atol=1e-5, msg=f"{rule} x{micro_batches}")


def fsdp_worker(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    part = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    for rule in ("InputAwareAdamW", "LazyAdamW", "InputAwareSGD", "NLMS", "WhitenedMuon"):
        model = Net()
        for module in (model.embed, model.hidden, model.out):
            fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = RULES[rule](model, BATCH // WORLD)
        for tokens, target in batches():
            optimizer.zero_grad()
            loss_of(model, tokens[part], target[part]).backward()
            optimizer.step()
        full = [p.full_tensor() for p in model.parameters()]  # type: ignore[attr-defined]
        if rank == 0:
            for p, q in zip(full, train_whole(rule), strict=True):
                torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=rule)


def assert_same_on_every_rank(tensors: list[torch.Tensor], what: str) -> None:
    """Bitwise the same tensors on every rank (replicated state)."""
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    for other in gathered[1:]:
        assert torch.equal(gathered[0], other), f"{what} differs between ranks"


def sharded_net(mesh: Any, dtype: torch.dtype = torch.float64, **shard_kwargs: Any) -> Net:
    """``Net`` in ``dtype``, each layer and the whole sharded with FSDP2 over ``mesh``."""
    from torch.distributed.fsdp import fully_shard

    model = Net().to(dtype)
    for module in (model.embed, model.hidden, model.out):
        fully_shard(module, mesh=mesh, **shard_kwargs)
    fully_shard(model, mesh=mesh, **shard_kwargs)
    return model


def train_sharded(rule: str, model: nn.Module, rank: int) -> Any:
    local = BATCH // dist.get_world_size()
    part = slice(rank * local, (rank + 1) * local)
    optimizer = RULES[rule](model, local)
    for tokens, target in batches():
        optimizer.zero_grad()
        loss_of(model, tokens[part], target[part].double()).backward()
        optimizer.step()
    return optimizer


def fsdp_kronecker_worker(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for rule in ("FOOF", "KFAC", "FOOF-shared", "KFAC-shared"):
        model = sharded_net(mesh)
        optimizer = train_sharded(rule, model, rank)
        # The factors and their inverses are replicated: every rank holds the same bits.
        factors = [
            v for p in model.parameters() for k, v in optimizer.rules[0].state[p].items() if k.endswith("_inverse")
        ]
        moments = [
            v for p in model.parameters() for k, v in optimizer.rules[0].state[p].items() if k.endswith("_moment")
        ]
        assert len(factors) == len(moments) == (2 if rule.startswith("FOOF") else 4)
        assert_same_on_every_rank(factors + moments, f"{rule}'s factors")
        full = [p.full_tensor() for p in model.parameters()]  # type: ignore[attr-defined]
        if rank == 0:
            for p, q in zip(full, train_whole(rule, torch.float64), strict=True):
                torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=rule)
    # A convolution's rows are its output channels: (out, in, kh, kw) sharded on dim 0.
    images = torch.randn(BATCH, 2, 5, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    local = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    for rule in ("FOOF", "KFAC-shared"):
        trained = []
        for sharded in (True, False):
            torch.manual_seed(0)
            conv = nn.Sequential(nn.Conv2d(2, 5, 3), nn.Tanh(), nn.Flatten(), nn.Linear(45, 3)).double()
            if sharded:
                for layer in (conv[0], conv[3], conv):
                    fully_shard(layer, mesh=mesh)
            whole = {} if sharded else {"process_group": None}  # the reference: this rank alone, on the whole batch
            optimizer = RULES[rule](conv, BATCH // WORLD if sharded else BATCH, **whole)
            for _ in range(STEPS):
                optimizer.zero_grad()
                conv(images[local] if sharded else images).pow(2).sum(1).mean().backward()
                optimizer.step()
            trained.append([p.full_tensor() if sharded else p.detach() for p in conv.parameters()])  # type: ignore[attr-defined]
        if rank == 0:
            for p, q in zip(*trained, strict=True):
                torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=f"{rule} on a convolution")
    # A layer sharded on its columns: its rows are not held whole, refused by name.
    model = sharded_net(mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    with pytest.raises(NotImplementedError, match="cannot precondition hidden under FSDP2: sharded as"):
        FOOF(model, lr=0.1)


def fsdp_dp_worker(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for rule in ("DPSGD", "DPAdamW"):
        model = sharded_net(mesh)
        train_sharded(rule, model, rank)
        full = [p.full_tensor() for p in model.parameters()]  # type: ignore[attr-defined]
        if rank == 0:
            for p, q in zip(full, train_whole(rule, torch.float64), strict=True):
                torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=rule)
    # The noise is drawn once, in full, on rank 0: each rank's shard is its slice of what DDP adds.
    part = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    trained = []
    engines: list[nn.Module] = [sharded_net(mesh), DistributedDataParallel(Net().double())]
    for engine in engines:
        generator = torch.Generator().manual_seed(7)  # the same seed on every rank; only rank 0 draws
        optimizer = DPSGD(
            engine,
            lr=0.5,
            max_grad_norm=0.1,
            noise_multiplier=1.0,
            expected_batch_size=BATCH // WORLD,
            generator=generator,
        )
        for tokens, target in batches():
            optimizer.zero_grad()
            loss_of(engine, tokens[part], target[part].double()).backward()
            optimizer.step()
        trained.append([p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in engine.parameters()])
    for p, q in zip(*trained, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg="noise under FSDP2 and DDP")
    assert_same_on_every_rank(trained[0], "DPSGD's noised parameters")
    # A sharded layer without a closed form (its per-sample gradients need the whole weights).
    gain = Gain(4)
    fully_shard(gain, mesh=mesh)
    with pytest.raises(NotImplementedError, match="per-sample gradients of gain under FSDP2"):
        DPSGD(nn.Sequential(OrderedDict(proj=nn.Linear(3, 4), gain=gain)), lr=0.1)
    # LayerNorm's closed form reads the inputs and output gradients only: sharded, it is exact.
    normed = []
    for sharded in (True, False):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).double()
        if sharded:
            fully_shard(net[1], mesh=mesh)
            fully_shard(net, mesh=mesh)
        samples = BATCH // WORLD if sharded else BATCH
        whole = {} if sharded else {"process_group": None}
        dp = DPSGD(net, lr=0.5, max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=samples, **whole)
        x = torch.randn(BATCH, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        for _ in range(STEPS):
            dp.zero_grad()
            net(x[part] if sharded else x).pow(2).sum(1).mean().backward()
            dp.step()
        normed.append([p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in net.parameters()])
    for p, q in zip(*normed, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg="DPSGD over a sharded LayerNorm")
    # HSDP (a 2-D mesh): the batch count and the noise would be combined over one dimension only.
    model = sharded_net(init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("replicate", "shard")))
    with pytest.raises(NotImplementedError, match="over a 1-D mesh only"):
        DPSGD(model, lr=0.1)
    with pytest.raises(NotImplementedError, match="over a 2-D mesh, not on rows"):
        FOOF(model, lr=0.1)
    with pytest.raises(NotImplementedError, match="NLMS supports FSDP2 over a 1-D mesh only"):
        NLMS(model, lr=0.1)
    with pytest.raises(NotImplementedError, match=r"rows of embed under FSDP2: sharded as .* over a 2-D mesh"):
        LazyAdamW(model, lr=0.1)
    # A table sharded on its columns (1-D mesh): its rows are not held whole.
    columns = sharded_net(mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    with pytest.raises(NotImplementedError, match=r"rows of embed under FSDP2: sharded as \(Shard\(dim=1\),\)"):
        LazyAdamW(columns, lr=0.1)


def inversion_worker(rank: int) -> None:
    from inputaware_optim import kronecker

    original = kronecker.damped_inverse
    inverted: list[str] = []

    def counted(matrix: torch.Tensor, damping: float, name: str, **options: Any) -> torch.Tensor:
        inverted.append(name)
        return original(matrix, damping, name, **options)

    kronecker.damped_inverse = counted
    part = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    for rule in ("FOOF", "KFAC"):
        params, names = {}, {}
        for shared in (False, True):
            inverted.clear()
            model = DistributedDataParallel(Net())
            optimizer = RULES[f"{rule}-shared" if shared else rule](model, BATCH // WORLD)
            for tokens, target in batches():
                optimizer.zero_grad()
                loss_of(model, tokens[part], target[part]).backward()
                optimizer.step()
            params[shared], names[shared] = [p.detach().clone() for p in model.parameters()], sorted(inverted)
        for p, q in zip(params[True], params[False], strict=True):
            assert torch.equal(p, q), f"{rule}: distributed inversion changed the parameters"
        # Without sharing every rank inverts every factor; with it, each its share, all of them once.
        shares: list[Any] = [None] * WORLD
        dist.all_gather_object(shares, names[True])
        assert sorted(name for share in shares for name in share) == names[False], (shares, names[False])
        assert all(0 < len(share) < len(names[False]) for share in shares), shares
    kronecker.damped_inverse = original
    # inverse="eigh": each eigendecomposition is computed on one rank and travels; every rank
    # forms the inverse from the same bits, so sharing the work changes none.
    for rule in ("FOOF", "KFAC"):
        trained = []
        for shared in (False, True):
            model = DistributedDataParallel(Net())
            optimizer = RULES[f"{rule}-shared" if shared else rule](model, BATCH // WORLD, inverse="eigh")
            for tokens, target in batches():
                optimizer.zero_grad()
                loss_of(model, tokens[part], target[part]).backward()
                optimizer.step()
            trained.append([p.detach().clone() for p in model.parameters()])
        for p, q in zip(*trained, strict=True):
            assert torch.equal(p, q), f"{rule}: distributed inversion with eigh changed the parameters"
    # An inversion that fails on its rank fails the step on every rank, with the same error.
    model = DistributedDataParallel(Net())
    optimizer = FOOF(model, lr=0.1, distributed_inversion=True)
    with torch.no_grad():
        model.module.embed.weight[0] = math.inf  # token 0's row: the hidden layer's statistics overflow
    before = [p.detach().clone() for p in model.parameters()]
    loss_of(model, torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 3)).backward()
    with pytest.raises(RuntimeError, match=r"statistics of hidden \(input\) are not finite"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def four_rank_worker(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    # 3 output rows over 4 ranks: one rank holds none of the out layer; FOOF's 2 factors leave
    # two ranks nothing to invert.
    mesh = init_device_mesh("cpu", (4,))
    for rule in ("FOOF-shared", "KFAC-shared", "DPSGD"):
        model = sharded_net(mesh)
        optimizer = train_sharded(rule, model, rank)
        factors = [
            v for p in model.parameters() for k, v in optimizer.rules[0].state[p].items() if k.endswith("_inverse")
        ]
        assert_same_on_every_rank(factors or [torch.zeros(1)], f"{rule}'s factors")
        full = [p.full_tensor() for p in model.parameters()]  # type: ignore[attr-defined]
        if rank == 0:
            for p, q in zip(full, train_whole(rule, torch.float64), strict=True):
                torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=rule)


class Branchy(nn.Module):
    """A layer that only some batches reach (as a routed expert or a conditional branch)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(4, 6)
        self.branch = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, branch: bool, functional: bool = False) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        if functional:  # the branch's weights used without calling it
            return self.head(h + nn.functional.linear(h, self.branch.weight, self.branch.bias))
        return self.head(h + self.branch(h) if branch else h)


BRANCHY_RULES: dict[str, Callable[..., Any]] = {
    "FOOF": lambda m, **kw: FOOF(m, lr=0.05, update_every=1, **kw),
    "KFAC": lambda m, **kw: KFAC(m, lr=0.05, update_every=1, damping=1e-2, **kw),
    "Eva": lambda m, **kw: Eva(m, lr=0.05, kl_clip=None, **kw),
    "NLMS": lambda m, **kw: NLMS(m, lr=0.1, **kw),
}


def unreached_layer_worker(rank: int) -> None:
    # Rank 1's batches never reach `branch`: it adds zero statistics for it, so both ranks reduce
    # the same list (before, rank 1 left the layer out: sums of different layers were added, or
    # the collective hung), and the factors are rank 0's alone, as one process would have them.
    generator = torch.Generator().manual_seed(3)
    data = [torch.randn(WORLD, 4, 4, generator=generator) for _ in range(STEPS)]
    targets = [torch.randn(WORLD, 4, 2, generator=generator) for _ in range(STEPS)]
    for rule, make in BRANCHY_RULES.items():
        model = DistributedDataParallel(Branchy(), find_unused_parameters=True)
        optimizer = make(model)
        for x, y in zip(data, targets, strict=True):
            optimizer.zero_grad()
            (model(x[rank], branch=rank == 0) - y[rank]).pow(2).mean().backward()
            optimizer.step()
        if rule == "FOOF":
            assert "input_second_moment" in optimizer.rules[0].state[model.module.branch.weight]
        assert_same_on_every_rank(list(model.parameters()), f"{rule}'s parameters")
        if rule not in ("FOOF", "NLMS"):
            continue  # (K-FAC's and Eva's output side scale by each rank's batch: one process differs)
        # One process: both halves as two micro-batches of half the loss each (DDP averages the ranks).
        reference = Branchy()
        whole = make(reference, process_group=None)
        for x, y in zip(data, targets, strict=True):
            whole.zero_grad()
            for part in range(WORLD):
                ((reference(x[part], branch=part == 0) - y[part]).pow(2).mean() / WORLD).backward()
            whole.step()
        for p, q in zip(model.module.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=rule)
    # DPSGD: rank 1's samples have a zero gradient for `branch`; both ranks add the same sums. One
    # process with both halves as micro-batches (each loss a sum over the global batch) is the reference.
    dp = {"lr": 0.5, "max_grad_norm": 0.05, "noise_multiplier": 0.0}
    model = DistributedDataParallel(Branchy().double(), find_unused_parameters=True)
    optimizer = DPSGD(model, expected_batch_size=4, **dp)
    for x, y in zip(data, targets, strict=True):
        optimizer.zero_grad()
        (model(x[rank].double(), branch=rank == 0) - y[rank]).pow(2).mean().backward()
        optimizer.step()
    assert_same_on_every_rank(list(model.parameters()), "DPSGD's parameters")
    reference = Branchy().double()
    whole = DPSGD(reference, expected_batch_size=4 * WORLD, process_group=None, **dp)
    for x, y in zip(data, targets, strict=True):
        whole.zero_grad()
        for part in range(WORLD):
            ((reference(x[part].double(), branch=part == 0) - y[part]).pow(2).mean(1).sum() / (4 * WORLD)).backward()
        whole.step()
    for p, q in zip(model.module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg="DPSGD")
    # A weight no rank's captured calls explain is refused on every rank alike (none is left waiting).
    model = DistributedDataParallel(Branchy())
    optimizer = DPSGD(model, expected_batch_size=4, **dp)
    (model(data[0][rank], branch=True, functional=True) - targets[0][rank]).pow(2).mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="no forward call of branch is in that gradient"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def _entry(rank: int, directory: str, port: int, worker: Callable[[int], None], world: int = WORLD) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    worker(rank)
    dist.barrier()  # no rank leaves while another still uses the group
    mark_done(directory, rank)  # every check of this rank passed
    # Leave without torch's teardown: torch 2.13's gloo teardown (destroy_process_group(), then
    # interpreter exit) now and then aborts a finished rank with "terminate called without an
    # active exception". Nothing is left to do or check, and nothing more goes over the group.
    os._exit(0)


def run_two_processes(worker: Callable[[int], None]) -> None:
    """Run ``worker(rank)`` on 2 gloo processes; raise if any rank failed."""
    run_processes(worker, WORLD)


def run_processes(worker: Callable[[int], None], world: int) -> None:
    """Run ``worker(rank)`` on ``world`` gloo processes; raise if any rank failed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_spawned(_entry, args=(port, worker, world), world=world)


@pytest.mark.slow
def test_ddp_replicas_stay_identical_and_match_one_process() -> None:
    run_two_processes(ddp_worker)


@pytest.mark.slow
def test_fsdp2_stock_lazy_adamw_nlms_and_whitened_muon_match_one_process() -> None:
    run_two_processes(fsdp_worker)


@pytest.mark.slow
def test_fsdp2_foof_and_kfac_match_one_process_with_replicated_factors() -> None:
    run_two_processes(fsdp_kronecker_worker)


@pytest.mark.slow
def test_fsdp2_dp_matches_one_process_and_its_noise_matches_ddp() -> None:
    run_two_processes(fsdp_dp_worker)


@pytest.mark.slow
def test_distributed_inversion_splits_the_work_and_changes_no_bit() -> None:
    run_two_processes(inversion_worker)


@pytest.mark.slow
def test_four_ranks_with_empty_shards_and_idle_inverters_match_one_process() -> None:
    run_processes(four_rank_worker, 4)


@pytest.mark.slow
def test_a_layer_one_rank_never_reaches_gets_its_statistics_from_the_others() -> None:
    run_two_processes(unreached_layer_worker)


def test_owners_by_cost_puts_the_costliest_first_on_the_least_loaded_rank() -> None:
    from inputaware_optim.distributed import computed_once, owners_by_cost

    assert owners_by_cost([27.0, 8.0, 27.0, 1.0, 1.0], 2) == [0, 0, 1, 1, 1]  # loads 35 and 29; ties to rank 0
    assert owners_by_cost([5.0, 5.0], 4) == [0, 1]  # ranks 2 and 3 idle
    assert owners_by_cost([], 3) == []
    jobs = [lambda: torch.ones(2), lambda: torch.zeros(3)]
    assert [t.tolist() for t in computed_once(jobs, [torch.ones(2), torch.zeros(3)], [1.0, 1.0], None)] == [
        [1.0, 1.0],
        [0.0, 0.0, 0.0],
    ]
