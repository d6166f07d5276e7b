"""Data parallelism: input statistics combined over the ranks that average gradients (a DDP wrapper's group,
or FSDP2's mesh), or the replicas would drift apart; this rank's rows of ``W̃ = [W | b]`` under FSDP2 (sharded
on dim 0 over a 1-D mesh), all a row-wise rule (FOOF's ``G̃ A⁻¹``) needs; work every rank would repeat, done once."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .capture import _wrapper_chain

__all__ = [
    "all_ranks_sum",
    "all_reduce_sum_",
    "computed_once",
    "data_parallel_group",
    "local_tensor",
    "owners_by_cost",
    "reduce_scatter_like",
    "row_range",
    "row_sharding_problem",
    "sharded",
]


def data_parallel_group(model: nn.Module) -> Any:
    """The process group over which ``model``'s gradients are averaged: a ``DistributedDataParallel``
    wrapper's, or that of the mesh FSDP2 shards its parameters over; else ``None``."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    for wrapper in _wrapper_chain(model):
        if isinstance(wrapper, nn.parallel.DistributedDataParallel):
            return wrapper.process_group
    mesh = next((p.device_mesh for p in model.parameters() if sharded(p)), None)  # type: ignore[attr-defined]
    return None if mesh is None else mesh.get_group() if mesh.ndim == 1 else mesh.get_group(0)


def inferred_group(model: nn.Module, owner: str) -> Any:
    """The group a model's data-parallel wrapper or FSDP2 mesh averages gradients over (``None`` in one process).

    Raises:
        RuntimeError: Under several ranks with nothing to infer it from (per-rank statistics would make the
            replicas drift apart; ``owner`` names the optimizer).
    """
    group = data_parallel_group(model)
    if group is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        ranks = torch.distributed.get_world_size()
        if ranks > 1:
            raise RuntimeError(
                f"{owner} combines input statistics over the data-parallel ranks, but its model is not wrapped in "
                f"DistributedDataParallel or sharded with fully_shard while torch.distributed runs {ranks} ranks, so "
                "each replica would apply a different update. Build the optimizer on the wrapped model "
                "(DistributedDataParallel(model)), or pass process_group= (the group gradients are averaged over, or "
                "None if each rank trains its own model)"
            )
    return group


def all_reduce_sum_(tensors: Sequence[Tensor], group: Any) -> None:
    """Sum ``tensors`` in place across ``group`` with one collective (no-op when ``group`` is ``None``)."""
    if group is None or not tensors:
        return
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    torch.distributed.all_reduce(flat, group=group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.copy_(part.view(t.shape))


def all_ranks_sum(
    values: Sequence[Tensor | None], shapes: Sequence[tuple[int, ...]], group: Any, device: torch.device
) -> list[Tensor | None]:
    """``values`` summed over ``group`` as ``float64`` (a ``None`` joins as zeros of its entry in ``shapes``,
    the same on every rank); without a group, ``values`` as they are."""
    if group is None:
        return list(values)
    joined = [
        torch.zeros(shape, dtype=torch.float64, device=device) if v is None else v.to(torch.float64, copy=True)
        for v, shape in zip(values, shapes, strict=True)
    ]
    all_reduce_sum_(joined, group)
    return list(joined)


def local_tensor(t: Tensor) -> Tensor:
    """The local shard of a DTensor (FSDP2), which in-place updates write through; else ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def all_zero(grads: Iterable[Tensor | None]) -> bool:
    """Whether every gradient given is zero (this rank's shard of it, under FSDP2; a sparse one's values)."""
    local = [local_tensor(g) for g in grads if g is not None]
    return not any(bool((g.coalesce().values() if g.is_sparse else g).any()) for g in local)


def sharded(t: Tensor) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2 parameter or gradient)."""
    return getattr(t, "device_mesh", None) is not None


def row_sharding_problem(weight: Tensor, bias: Tensor | None) -> str | None:
    """Why the rows of ``[weight | bias]`` are not held whole by the ranks (both sharded on dim 0 over the
    same 1-D mesh, FSDP2's default), or ``None`` if they are."""
    tensors = [weight] if bias is None else [weight, bias]
    if not any(sharded(t) for t in tensors):
        return None
    if not all(sharded(t) for t in tensors):
        return "the weight and the bias are not both sharded"
    mesh = weight.device_mesh  # type: ignore[attr-defined]
    for t in tensors:
        placements = t.placements  # type: ignore[attr-defined]
        if t.device_mesh != mesh or mesh.ndim != 1 or not placements[0].is_shard(0):  # type: ignore[attr-defined]
            return f"sharded as {tuple(placements)} over a {mesh.ndim}-D mesh, not on rows (Shard(0)) over a 1-D mesh"
    if bias is not None and local_tensor(weight).shape[0] != local_tensor(bias).shape[0]:
        return "this rank holds different rows of the weight and of the bias"
    return None


def row_range(t: Tensor) -> slice:
    """The global rows that this rank's shard of ``t`` holds (``t`` sharded on dim 0 over a 1-D mesh)."""
    mesh = t.device_mesh  # type: ignore[attr-defined]
    chunk = -(-t.shape[0] // mesh.size())  # FSDP2 shards like torch.chunk: the last ranks hold fewer rows, or none
    start = min(mesh.get_local_rank() * chunk, t.shape[0])
    held = local_tensor(t).shape[0]
    if start + held > t.shape[0] or held > chunk:
        raise RuntimeError(f"unexpected row sharding: rows {start}:{start + held} of {t.shape[0]} on this rank")
    return slice(start, start + held)


def local_matrix_rows(weight: Tensor, bias: Tensor | None, homogeneous: bool) -> Tensor:
    """This rank's rows of ``G̃ = [grad W | grad b]`` (weight flattened past dim 0; bias last when ``homogeneous``)."""
    return _matrix_rows(weight, bias, homogeneous, local_tensor)


def full_matrix_rows(weight: Tensor, bias: Tensor | None, homogeneous: bool) -> Tensor:
    """All of ``G̃``, gathered from every rank's rows (one all-gather of the weight's, one of the bias's gradient)."""
    return _matrix_rows(weight, bias, homogeneous, lambda t: t.full_tensor())  # type: ignore[attr-defined]


def _matrix_rows(weight: Tensor, bias: Tensor | None, homogeneous: bool, read: Callable[[Tensor], Tensor]) -> Tensor:
    assert weight.grad is not None
    grad = read(weight.grad)
    matrix = grad.reshape(grad.shape[0], math.prod(weight.shape[1:]))
    if homogeneous:
        assert bias is not None and bias.grad is not None
        matrix = torch.cat([matrix, read(bias.grad).reshape(-1, 1)], dim=1)
    return matrix


def set_local_matrix_rows(weight: Tensor, bias: Tensor | None, matrix: Tensor, homogeneous: bool) -> None:
    """Write this rank's rows of a ``G̃``-shaped matrix into the local shards of the gradients."""
    assert weight.grad is not None
    grad = local_tensor(weight.grad)
    columns = math.prod(weight.shape[1:])
    grad.copy_(matrix[:, :columns].reshape(grad.shape))
    if homogeneous:
        assert bias is not None and bias.grad is not None
        local_tensor(bias.grad).copy_(matrix[:, columns])


def reduce_scatter_like(full: Tensor, like: Tensor) -> Tensor:
    """This rank's shard, placed as the DTensor ``like``, of ``full`` summed over its mesh (one reduce-scatter)."""
    from torch.distributed.tensor import DTensor, Partial

    mesh = like.device_mesh  # type: ignore[attr-defined]
    partial = DTensor.from_local(full, mesh, [Partial()] * mesh.ndim, shape=full.shape, stride=full.stride())
    return partial.redistribute(mesh, like.placements).to_local()  # type: ignore[attr-defined]


def owners_by_cost(costs: Sequence[float], world: int) -> list[int]:
    """The rank each job runs on: the costliest first, each to the least loaded rank (ties: the lowest)."""
    loads = [0.0] * world
    owners = [0] * len(costs)
    for job in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        owners[job] = rank = min(range(world), key=lambda r: (loads[r], r))
        loads[rank] += costs[job]
    return owners


def computed_once(
    jobs: Sequence[Callable[[], Tensor]], likes: Sequence[Tensor], costs: Sequence[float], group: Any
) -> list[Tensor]:
    """Every job's result on every rank of ``group``, each computed on one rank (``owners_by_cost``) and
    broadcast (once per rank and dtype); job ``j`` returns a tensor like ``likes[j]``, every rank passes the
    same jobs. A job that raises on its rank is run again by every rank after the collectives (no rank is left
    waiting), so all raise its error. Without a group, every job runs here."""
    dist = torch.distributed
    if group is None or not jobs or dist.get_world_size(group) == 1:
        return [job() for job in jobs]
    world, me = dist.get_world_size(group), dist.get_rank(group)
    owners = owners_by_cost(costs, world)
    results: list[Tensor | None] = [None] * len(jobs)
    failed = torch.zeros(len(jobs), dtype=torch.int32, device=likes[0].device)
    for j, job in enumerate(jobs):
        if owners[j] == me:
            try:
                results[j] = job()
            except Exception:
                failed[j] = 1
    dist.all_reduce(failed, group=group)
    if bool(failed.any()):
        for j in failed.nonzero().flatten().tolist():
            jobs[j]()  # raises here too, with the message its owner got
        raise RuntimeError(f"jobs {failed.nonzero().flatten().tolist()} failed on their ranks but not here")
    batches: dict[tuple[int, torch.dtype], list[int]] = {}  # a broadcast per rank and dtype, the same on every rank
    for j in sorted(range(len(jobs)), key=lambda j: owners[j]):
        batches.setdefault((owners[j], likes[j].dtype), []).append(j)
    for (rank, dtype), members in batches.items():
        if rank == me:
            flat = torch.cat([results[j].reshape(-1) for j in members])  # type: ignore[union-attr]
        else:
            flat = torch.empty(sum(likes[j].numel() for j in members), dtype=dtype, device=likes[members[0]].device)
        dist.broadcast(flat, src=dist.get_global_rank(group, rank), group=group)
        for j, part in zip(members, flat.split([likes[j].numel() for j in members]), strict=True):
            results[j] = part.view(likes[j].shape).clone()  # not a view of them all
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]
