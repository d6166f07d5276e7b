"""Data parallelism: input statistics combined over the ranks that average gradients (a DDP wrapper's group,
or FSDP2's mesh), or the replicas would drift apart; this rank's rows of ``W̃ = [W | b]`` under FSDP2 (sharded
on dim 0 over a 1-D mesh), all a row-wise rule (FOOF's ``G̃ A⁻¹``) needs; work every rank would repeat, done once.
Tensor parallelism (``parallelize_module``): which mesh dimensions of a DTensor parameter are FSDP2's and which
tensor parallelism's (``ParallelLayout``), and how it splits a layer (``tensor_parallel_style``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ._torch import tree_map_only
from .capture import _wrapper_chain
from .inputs import Call

__all__ = [
    "ParallelLayout",
    "all_ranks_sum",
    "all_reduce_sum_",
    "computed_once",
    "data_parallel_group",
    "gathered_rows",
    "local_call",
    "local_tensor",
    "owners_by_cost",
    "reduce_scatter_like",
    "row_range",
    "row_sharding_problem",
    "sharded",
    "tensor_parallel_style",
]


def data_parallel_group(model: nn.Module) -> Any:
    """The process group over which ``model``'s gradients are averaged: a ``DistributedDataParallel``
    wrapper's, or that of FSDP2's mesh dimension (the first of its parameters' meshes: under FSDP2 x tensor
    parallelism the others are tensor parallelism's); else ``None`` (tensor parallelism alone averages nothing)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    for wrapper in _wrapper_chain(model):
        if isinstance(wrapper, nn.parallel.DistributedDataParallel):
            return wrapper.process_group
    spread = [p for p in model.parameters() if sharded(p)]
    layout = ParallelLayout(model) if spread else None
    mesh = next((p.device_mesh for p in spread if layout and layout.data_dims(p)), None)  # type: ignore[attr-defined]
    return None if mesh is None else mesh.get_group() if mesh.ndim == 1 else mesh.get_group(0)


def inferred_group(model: nn.Module, owner: str) -> Any:
    """The group a model's data-parallel wrapper or FSDP2 mesh averages gradients over (``None`` in one process,
    and under tensor parallelism alone over every rank: each rank sees the whole batch).

    Raises:
        RuntimeError: Under several ranks with nothing to infer it from (per-rank statistics would make the
            replicas drift apart; ``owner`` names the optimizer).
    """
    group = data_parallel_group(model)
    if group is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        ranks = torch.distributed.get_world_size()
        if ranks > 1 and not _tensor_parallel_over_every_rank(model, ranks):
            raise RuntimeError(
                f"{owner} combines input statistics over the data-parallel ranks, but its model is not wrapped in "
                f"DistributedDataParallel or sharded with fully_shard while torch.distributed runs {ranks} ranks, so "
                "each replica would apply a different update. Build the optimizer on the wrapped model "
                "(DistributedDataParallel(model)), or pass process_group= (the group gradients are averaged over, or "
                "None if each rank trains its own model)"
            )
    return group


def _tensor_parallel_over_every_rank(model: nn.Module, ranks: int) -> bool:
    """Whether ``model`` is tensor-parallel over a mesh of all ``ranks`` (so no rank holds a replica of its own)."""
    return any(sharded(p) and p.device_mesh.size() == ranks for p in model.parameters())  # type: ignore[attr-defined]


class ParallelLayout:
    """How a model's DTensor parameters are spread over the ranks: which mesh dimensions are FSDP2's (data
    parallelism: the first, HSDP's first two) and which tensor parallelism's (every other one, as
    ``parallelize_module`` leaves them). A parameter ``fully_shard`` manages lives under an ``FSDPModule``; the
    tensor-parallel plan is not recorded on the module, so the placements say how a layer is split."""

    def __init__(self, model: nn.Module) -> None:
        self._fsdp: set[int] = set()
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # (a torch without FSDP2)
            return
        modules = [model]
        while modules:  # (the outermost FSDPModules manage every parameter below them)
            module = modules.pop()
            if isinstance(module, FSDPModule):
                self._fsdp.update(id(p) for p in module.parameters())
            else:
                modules += module.children()

    def data_dims(self, t: Tensor) -> tuple[int, ...]:
        """The mesh dimensions FSDP2 shards (or, HSDP's first, replicates) parameter ``t`` over."""
        if not sharded(t) or id(t) not in self._fsdp:
            return ()
        mesh, placements = t.device_mesh, t.placements  # type: ignore[attr-defined]
        return (0, 1) if mesh.ndim > 1 and placements[0].is_replicate() else (0,)

    def tensor_dims(self, t: Tensor) -> tuple[int, ...]:
        """The mesh dimensions tensor parallelism shards or replicates parameter ``t`` over."""
        if not sharded(t):
            return ()
        return tuple(d for d in range(t.device_mesh.ndim) if d not in self.data_dims(t))  # type: ignore[attr-defined]

    def tensor_placements(self, t: Tensor) -> tuple[Any, ...]:
        """``t``'s placements on its tensor-parallel mesh dimensions."""
        return tuple(t.placements[d] for d in self.tensor_dims(t))  # type: ignore[attr-defined]

    def tensor_group(self, t: Tensor) -> Any:
        """The process group of ``t``'s tensor-parallel mesh dimension (``None`` if it has none)."""
        dims = self.tensor_dims(t)
        if not dims:
            return None
        if len(dims) > 1:
            raise NotImplementedError(f"more than one tensor-parallel mesh dimension ({len(dims)})")
        return t.device_mesh.get_group(dims[0])  # type: ignore[attr-defined]

    def tensor_local_shape(self, t: Tensor) -> torch.Size:
        """The shape of this rank's part of ``t`` under tensor parallelism alone (before FSDP2 shards it)."""
        return torch.Size(len(self.tensor_range(t, dim)) for dim in range(t.dim()))

    def tensor_local(self, full: Tensor, t: Tensor) -> Tensor:
        """This rank's part, under tensor parallelism alone, of ``full`` (a tensor of ``t``'s global shape)."""
        for dim in range(t.dim()):
            held = self.tensor_range(t, dim)
            if len(held) != full.shape[dim]:
                full = full.narrow(dim, held.start, len(held))
        return full

    def tensor_range(self, t: Tensor, dim: int = 0) -> range:
        """The global indices along ``dim`` of ``t`` in this rank's part under tensor parallelism alone."""
        return self._range(t, dim, self.tensor_dims(t))

    def held_rows(self, t: Tensor) -> slice:
        """The global rows (dim 0) of ``t`` this rank's local shard holds: tensor parallelism's share, then FSDP2's
        share of that (FSDP2 shards each rank's tensor-parallel part: ``_StridedShard`` on the joint mesh)."""
        rows = self._range(t, 0, (*self.tensor_dims(t), *self.data_dims(t)))
        if len(rows) != local_tensor(t).shape[0]:
            raise RuntimeError(
                f"unexpected row sharding: {len(rows)} rows expected on this rank, it holds {local_tensor(t).shape[0]}"
            )
        return slice(rows.start, rows.start + len(rows))

    @staticmethod
    def _range(t: Tensor, dim: int, mesh_dims: Sequence[int]) -> range:
        indices = range(t.shape[dim])
        for d in mesh_dims:
            if shard_dim(t.placements[d]) == dim:  # type: ignore[attr-defined]
                indices = _chunk(indices, t.device_mesh.size(d), t.device_mesh.get_local_rank(d))  # type: ignore[attr-defined]
        return indices


def shard_dim(placement: Any) -> int | None:
    """The tensor dimension a placement shards (``Shard`` or FSDP2's strided shard), else ``None``."""
    if placement.is_shard() or getattr(placement, "split_factor", None) is not None:
        return int(placement.dim)
    return None


def _chunk(items: range, parts: int, index: int) -> range:
    """Part ``index`` of ``items`` split in ``parts`` as ``torch.chunk`` splits (the last parts smaller, or empty)."""
    size = -(-len(items) // parts)
    return items[min(index * size, len(items)) : min((index + 1) * size, len(items))]


def tensor_parallel_style(layout: ParallelLayout, weight: Tensor, bias: Tensor | None) -> str | None:
    """How tensor parallelism splits the matrix layer of ``weight`` and ``bias`` (``None``: it does not):
    ``"columns"`` (its output features, as ``ColwiseParallel``: weight and bias on ``Shard(0)``), ``"rows"``
    (its input features, as ``RowwiseParallel``: weight on ``Shard(1)``, bias replicated), ``"replicated"``, or
    a description of another layout."""
    tensors = [weight] if bias is None else [weight, bias]
    if not any(layout.tensor_dims(t) for t in tensors):
        return None
    placements = [layout.tensor_placements(t) for t in tensors]
    if any(len(p) != 1 for p in placements):
        return f"sharded over {max(len(p) for p in placements)} tensor-parallel mesh dimensions"
    found = [p[0] for p in placements]
    if all(p.is_shard(0) for p in found):
        return "columns"
    if found[0].is_shard(1) and all(p.is_replicate() for p in found[1:]):
        return "rows"
    if all(p.is_replicate() for p in found):
        return "replicated"
    return f"placed as {', '.join(map(str, found))} (weight{', bias' if bias is not None else ''})"


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


def gathered_rows(local: Tensor, like: Tensor) -> Tensor:
    """The whole matrix of which this rank holds the rows ``local``, the rows ``like`` (a parameter sharded on dim 0
    over a 1-D mesh, as ``row_range``) holds: one all-gather."""
    from torch.distributed.tensor import DTensor

    shape = torch.Size((like.shape[0], *local.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    placed = DTensor.from_local(
        local.contiguous(),
        like.device_mesh,  # type: ignore[attr-defined]
        like.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=shape,
        stride=stride,
    )
    return placed.full_tensor()


def set_local_matrix_rows(weight: Tensor, bias: Tensor | None, matrix: Tensor, homogeneous: bool) -> None:
    """Write this rank's rows of a ``G̃``-shaped matrix into the local shards of the gradients."""
    assert weight.grad is not None
    grad = local_tensor(weight.grad)
    columns = math.prod(weight.shape[1:])
    grad.copy_(matrix[:, :columns].reshape(grad.shape))
    if homogeneous:
        assert bias is not None and bias.grad is not None
        local_tensor(bias.grad).copy_(matrix[:, columns])


def reduce_scatter_like(full: Tensor, like: Tensor, data_dims: Sequence[int] | None = None) -> Tensor:
    """This rank's shard, placed as the DTensor ``like``, of ``full`` summed over ``like``'s data-parallel mesh
    dimensions ``data_dims`` (default: all of them) with one reduce-scatter. Under FSDP2 x tensor parallelism
    ``full`` is this rank's tensor-parallel part, which FSDP2 shards on its own dimension."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = like.device_mesh  # type: ignore[attr-defined]
    data = range(mesh.ndim) if data_dims is None else data_dims
    # Over the tensor-parallel dimensions ``full`` is taken as it is (Replicate: no communication there).
    given = [Partial() if d in data else Replicate() for d in range(mesh.ndim)]
    wanted = []
    for d, placement in enumerate(like.placements):  # type: ignore[attr-defined]
        dim = shard_dim(placement)
        wanted.append(Replicate() if d not in data or dim is None else Shard(dim))
    partial = DTensor.from_local(full, mesh, given, shape=full.shape, stride=full.stride())
    return partial.redistribute(mesh, wanted).to_local()


def local_call(call: Call, grads: bool = False) -> Call:
    """``call`` with every DTensor argument (and with ``grads``, output gradient) as this rank's local tensor, as
    the layer's own computation saw it (a partial sum summed over its ranks first); ``call`` itself without one."""
    leaves = [*call.args, *call.kwargs.values(), *(call.grad_outputs if grads and call.has_grad_outputs else ())]
    if not any(isinstance(t, Tensor) and sharded(t) for t in leaves):
        return call
    slot = call._grad_slot
    if grads and slot is not None:
        slot = [_local(g) if isinstance(g, Tensor) else g for g in slot]
    args, kwargs = tree_map_only(Tensor, _local, (call.args, call.kwargs))
    return Call(call.module, args, kwargs, slot, call.forward, call.output)


def _local(t: Tensor) -> Tensor:
    if not sharded(t):
        return t
    if any(p.is_partial() for p in t.placements):  # type: ignore[attr-defined]
        from torch.distributed.tensor import Replicate

        placements = [Replicate() if p.is_partial() else p for p in t.placements]  # type: ignore[attr-defined]
        t = t.redistribute(t.device_mesh, placements)  # type: ignore[attr-defined]
    return t.to_local()  # type: ignore[attr-defined]


def matched_grad(param: Tensor) -> Tensor | None:
    """``param``'s gradient placed as ``param`` is (a DTensor's gradient may come replicated or partial where the
    parameter is sharded, as tensor parallelism's vocabulary-sharded embedding and sequence-parallel norms leave
    it), set as its ``.grad``; the gradient as it is otherwise."""
    grad = param.grad
    if grad is None or not sharded(param) or not sharded(grad):
        return grad
    if tuple(grad.placements) != tuple(param.placements):  # type: ignore[attr-defined]
        grad = param.grad = grad.redistribute(param.device_mesh, param.placements)  # type: ignore[attr-defined]
    return grad


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
