"""Data-parallel synchronization of the statistics rules build from inputs.

Under data parallelism each rank captures its own local batch. A rule whose update
depends on input statistics (FOOF's second moment, NLMS's input power, LazyAdamW's
touched rows) must combine them across ranks, or replicas would apply different updates
and drift apart. The ranks to combine over are those that average gradients: the
``DistributedDataParallel`` wrapper's process group, or FSDP2's data-parallel mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["all_reduce_sum_", "data_parallel_group", "local_tensor"]


def data_parallel_group(model: nn.Module) -> Any:
    """The process group over which ``model``'s gradients are averaged, or ``None`` (one process).

    ``DistributedDataParallel``: its ``process_group``. FSDP2 (``fully_shard``): the group of
    the mesh its parameters are sharded over. Otherwise ``None``: statistics stay local.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from torch.nn.parallel import DistributedDataParallel

    from .capture import _wrapper_chain

    for wrapper in _wrapper_chain(model):
        if isinstance(wrapper, DistributedDataParallel):
            return wrapper.process_group
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)  # a DTensor parameter: FSDP2 shards over this mesh
        if mesh is not None:
            return mesh.get_group() if mesh.ndim == 1 else mesh.get_group(0)
    return None


def all_reduce_sum_(tensors: Sequence[Tensor], group: Any) -> None:
    """Sum ``tensors`` in place across ``group`` with one collective (no-op when ``group`` is ``None``)."""
    if group is None or not tensors:
        return
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    torch.distributed.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()


def local_tensor(t: Tensor) -> Tensor:
    """The local shard of a DTensor (FSDP2), which in-place updates write through; else ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t
