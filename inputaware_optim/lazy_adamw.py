"""LazyAdamW: AdamW that updates only the embedding rows a step actually used."""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from ._torch import fused_adamw_, set_grad_enabled
from .adamw import InputAwareAdamW
from .capture import Storage, module_names
from .coverage import CoverageWarning, warn_if_no_layers
from .distributed import (
    ParallelLayout,
    all_zero,
    local_call,
    local_tensor,
    matched_grad,
    row_sharding_problem,
    shard_dim,
    sharded,
)
from .inputs import Call, Captured, Inputs
from .layers import LayerKind, layer_kind, weight_of, weight_or_none
from .reduction import Reduction
from .rule import Rule

__all__ = ["LazyAdamW"]


class TouchedRows(Reduction):
    """Per call, in the forward hook: the rows of the embedding table it read (sorted, unique)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.kinds: dict[nn.Module, LayerKind] = {m: kind for m in modules if (kind := layer_kind(m)) is not None}
        self.made: dict[int, list[list[tuple[int, int]]]] = {}  # weight id -> per call: the gradients it sent
        self.extra: dict[int, Tensor] = {}  # weight id -> rows with gradient from elsewhere

    def wants(self, module: nn.Module) -> bool:
        return module in self.kinds

    def keys(self, module: nn.Module) -> tuple[Tensor, ...]:
        return (weight_of(module),)

    def forward(self, call: Call) -> Any:
        if getattr(call.module, "sparse", False):
            return None  # its gradient will list the rows itself
        return self.kinds[call.module].touched_rows(call.module, Captured([local_call(call)]))

    def combine(self, a: Any, b: Any) -> Any:
        if a is None or b is None:
            return b if a is None else a
        return torch.unique(torch.cat([a, b]))

    # -- the audit: rows with gradient from elsewhere (a tied head ``F.linear(h, embed.weight)``) --------
    # Free when one call is the table's only contribution in a backward pass (the gradient reaching
    # the weight is that call's own: same storage, same version); else the gradient is read once.

    def receives(self, module: nn.Module, param: Tensor) -> bool:
        return param is weight_of(module) and not sharded(param)  # (FSDP2: not reached)

    def produced(self, module: nn.Module, grad_inputs: Any) -> None:
        made = [(t.data_ptr(), t._version) for t in grad_inputs if isinstance(t, Tensor) and t.layout == torch.strided]
        self.made.setdefault(id(weight_of(module)), []).append(made)

    def arrived(self, param: Tensor, incoming: Tensor) -> None:
        produced = self.made.pop(id(param), [])
        if incoming.is_sparse:
            return  # sparse contributions list their own rows (the step reads the indices)
        if len(produced) == 1 and (incoming.data_ptr(), incoming._version) in produced[0]:
            return  # exactly the one captured call's gradient
        rows = incoming.reshape(incoming.shape[0], -1).ne(0).any(1).nonzero().squeeze(1)
        self.extra[id(param)] = self.combine(self.extra.get(id(param)), rows)

    def take(self, weight: Tensor) -> Tensor | None:
        """The rows with gradient from elsewhere that still hold gradient now (stale ones drop out)."""
        rows = self.extra.pop(id(weight), None)
        grad = weight.grad
        if rows is None or grad is None or rows.numel() == 0:
            return None
        rows = rows[grad.index_select(0, rows).reshape(rows.numel(), -1).ne(0).any(1)]
        return rows if rows.numel() else None


class _RowsRead(Rule):
    """What LazyAdamW reads (its row update is AdamW's own, in its ``step``): the touched rows of the tables it
    trains, each whose weight no other module uses."""

    layers = "touched_rows"
    changes_gradients = False

    def __init__(self) -> None:
        self.rows: TouchedRows | None = None
        self.layout: ParallelLayout | None = None

    @property
    def reads(self) -> list[Reduction]:  # type: ignore[override]
        return [] if self.rows is None else [self.rows]

    def setup(self, optimizer: Any) -> None:
        """Refuse, by name, a table not sharded on its rows (FSDP2's default) or, under tensor parallelism, on its
        rows (the vocabulary, RowwiseParallel) or features (ColwiseParallel): its touched rows could not be found."""
        trained = set(optimizer._params())
        self.layout = layout = ParallelLayout(optimizer.model)
        for module, name in module_names(optimizer.model).items():
            kind, weight = layer_kind(module), weight_or_none(module)
            if kind is None or not kind.provides("touched_rows") or weight is None or weight not in trained:
                continue
            if layout.tensor_dims(weight):
                if (problem := _tensor_parallel_problem(layout, weight)) is not None:
                    raise NotImplementedError(
                        f"LazyAdamW cannot update the rows of {name or type(module).__name__} under tensor "
                        f"parallelism: {problem}. Parallelize it with RowwiseParallel (its vocabulary) or "
                        "ColwiseParallel, or leave it out of the optimizer's params"
                    )
            elif (problem := row_sharding_problem(weight, None)) is not None:
                raise NotImplementedError(
                    f"LazyAdamW cannot update the rows of {name or type(module).__name__} under FSDP2: {problem}. "
                    "Shard it with fully_shard's default placement, or leave it out of the optimizer's params"
                )
        self.rows = TouchedRows([module for module, _, _ in lazy_tables(optimizer)])

    def treatment(self, optimizer: Any, param: Tensor, module: nn.Module | None) -> tuple[str, str | None, bool] | None:
        if any(weight is param for _, weight, _ in lazy_tables(optimizer)):
            return "LazyAdamW: touched rows only", None, False
        kind = layer_kind(module) if module is not None else None
        if kind is not None and kind.provides("touched_rows") and param is getattr(module, "weight", None):
            return "stock AdamW (dense)", "the table is shared with another module, so every row gets gradient", True
        return None


def _tensor_parallel_problem(layout: ParallelLayout, weight: Tensor) -> str | None:
    """Why the rows a rank holds of a table tensor parallelism splits cannot be told (``None``: they can)."""
    placements = layout.tensor_placements(weight)
    if len(placements) > 1:
        return f"it is split over {len(placements)} tensor-parallel mesh dimensions"
    if shard_dim(placements[0]) not in (0, 1, None):
        return f"it is placed as {placements[0]}"
    data = layout.data_dims(weight)
    if len(data) > 1 or any(shard_dim(weight.placements[d]) != 0 for d in data):  # type: ignore[attr-defined]
        return f"FSDP2 shards it as {tuple(weight.placements)}, not on rows over one mesh dimension"  # type: ignore[attr-defined]
    return None


def lazy_tables(optimizer: Any) -> list[tuple[nn.Module, Tensor, dict[str, Any]]]:
    """The captured embeddings ``optimizer`` trains whose weight no other module uses (a tied weight gets gradient
    on every row), with weight and param group."""
    return [(t.module, weight_of(t.module), t.group) for t in optimizer.layers("touched_rows") if len(t.owners) == 1]


class LazyAdamW(InputAwareAdamW):
    r"""AdamW whose embedding tables update only the rows the step's inputs touched.

    For each ``nn.Embedding`` and ``nn.EmbeddingBag`` (whose weight no other module uses),
    let :math:`R` be the rows indexed by the step's captured inputs (``padding_idx``
    excluded, the union over data-parallel ranks). For :math:`r \in R`, with the optimizer's
    step count :math:`t` (as ``torch.optim.SparseAdam`` and TF Addons' LazyAdam do):

    .. math::
        \theta_r &\leftarrow \theta_r (1 - \gamma\lambda) \\
        m_r &\leftarrow \beta_1 m_r + (1-\beta_1) g_r, \qquad
        v_r \leftarrow \beta_2 v_r + (1-\beta_2) g_r^2 \\
        \theta_r &\leftarrow \theta_r - \frac{\gamma}{1-\beta_1^t}\,
            \frac{m_r}{\sqrt{v_r / (1-\beta_2^t)} + \epsilon}

    (with ``amsgrad``, :math:`v_r` in the denominator is its running maximum), by torch's fused
    AdamW kernel on the gathered rows, so each moves bitwise as ``AdamW(fused=True)`` would move
    it. Rows with gradient that no captured call read move too (warned about once). Every other
    row and its moments stay bitwise unchanged; every other parameter gets stock AdamW, bitwise.
    ``sparse=True`` embeddings are the fast path (see docs/rules/lazy-adamw.md). The state has
    AdamW's keys, so a state dict moves between this class and ``torch.optim.AdamW``.

    Args:
        model: The model (``torch.compile``\ d and ``DistributedDataParallel`` wrappers too).
        lr: Learning rate :math:`\gamma`, as ``torch.optim.AdamW``.
        betas: :math:`(\beta_1, \beta_2)`, the moments' decay rates.
        eps: :math:`\epsilon`, added to the denominator.
        weight_decay: :math:`\lambda`, the decoupled weight decay (applied to touched rows only).
        amsgrad: Divide by the running maximum of the second moment.
        params: Parameters or param groups of ``model`` (default: all that require grad).
        maximize: Maximize the objective.
        foreach: ``torch.optim.AdamW``'s flag, for the parameters that get the stock update.
        fused: ``torch.optim.AdamW``'s flag, for the parameters that get the stock update.
        capturable: Not supported (the rows a step updates are data-dependent); must be False.
        differentiable: Not supported; must be False.
        storage: How captured tensors are kept: ``"reference"`` (zero-copy), ``"clone"``, ``"cpu"``.
        grad_outputs: Also capture each call's output gradients.
        grad_scaler: The ``torch.amp.GradScaler`` the loss is scaled by.
        strict: Refuse, at the first step, any parameter left to the stock update.
        process_group: The group touched rows are combined over; ``"infer"`` (default) reads it from
            the model's DDP wrapper or FSDP2 mesh, ``None`` keeps them per rank.
        base: Not supported (the row update is AdamW's own); must be None.
        rules: Not supported (the row update is AdamW's own); must be empty.
    """

    reads_calls = False  # (its step reads the rows its rule reads)

    def __init__(
        self,
        model: nn.Module,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        params: Any = None,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        storage: Storage = "reference",
        grad_outputs: bool | None = None,
        grad_scaler: Any = None,
        strict: bool = False,
        process_group: Any = "infer",
        base: None = None,
        rules: Any = (),
    ) -> None:
        if base is not None or rules:
            raise TypeError("LazyAdamW's row update is AdamW's own: it takes no base optimizer and no rules")
        for flag, value in (("capturable", capturable), ("differentiable", differentiable)):
            if value:
                raise ValueError(f"LazyAdamW does not support {flag}=True (its row updates are data-dependent)")
        super().__init__(
            model,
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
            storage=storage,
            grad_outputs=grad_outputs,
            grad_scaler=grad_scaler,
            strict=strict,
            process_group=process_group,
            rules=[_RowsRead()],
        )
        warn_if_no_layers(self, "touched_rows", "nn.Embedding or nn.EmbeddingBag")
        self._warned_extra: set[int] = set()

    @property
    def _rows(self) -> TouchedRows:
        rows = self.rules[0].rows  # type: ignore[attr-defined]
        assert rows is not None
        return rows

    def _lazy_tables(self) -> list[tuple[nn.Module, Tensor, dict[str, Any]]]:
        return lazy_tables(self)

    def step(self, closure: Any = None, inputs: Inputs | None = None) -> Any:
        """Update the touched embedding rows lazily and everything else with stock AdamW."""
        assert inputs is not None
        grad_enabled = torch.is_grad_enabled()
        set_grad_enabled(False)  # torch.no_grad() without its context manager's cost (10-15 µs a step)
        try:
            updates = self._row_updates(inputs)  # every check first: a step that raises changes nothing
            lazy = [update.weight for update in updates]
            hidden = {id(weight) for weight in lazy}
            loss = closure() if closure is not None else None  # (the library ran it: its loss)
            if any(p.grad is not None and id(p) not in hidden for group in self.param_groups for p in group["params"]):
                grads = [weight.grad for weight in lazy]
                for weight in lazy:  # hidden from the stock kernel, which skips a parameter whose grad is None
                    weight.grad = None
                try:
                    super().step(inputs=inputs)
                finally:
                    for weight, grad in zip(lazy, grads, strict=True):
                        weight.grad = grad
            for update in updates:
                self._update_rows(update)
        finally:
            set_grad_enabled(grad_enabled)
        return loss

    def _row_updates(self, inputs: Inputs) -> list[_RowUpdate]:
        """The lazy tables with a gradient this step, with their rows (their weight rows gathered)."""
        touched: dict[Tensor, Tensor] | None = None  # (read only for a dense gradient)
        updates: list[_RowUpdate] = []
        from_inputs: list[_RowUpdate] = []
        for module, weight, group in self._lazy_tables():
            grad = weight.grad
            if grad is None:
                continue  # AdamW skips it too
            if grad.is_sparse:  # sparse=True: the gradient lists the rows itself (coalesced: sorted, unique)
                weight.grad = grad = grad.coalesce()
                updates.append(_RowUpdate(module, weight, grad.indices()[0], group))
                continue
            touched = inputs.reduced(self._rows) if touched is None else touched
            rows = self._rows_of(module, weight, touched, inputs)
            matched_grad(weight)  # (tensor parallelism may leave it replicated where the table is sharded)
            if rows is not None:  # (None: no inputs were captured; stock AdamW updates it densely, Inputs warns)
                from_inputs.append(_RowUpdate(module, weight, rows, group))
        ranks = self.data_parallel_group if from_inputs else None
        if ranks is not None:  # (a sparse gradient's rows are already every rank's: DDP sums it)
            for update in from_inputs:
                touched_here = torch.zeros(update.weight.shape[0], dtype=torch.int32, device=update.rows.device)
                touched_here[update.rows] = 1
                torch.distributed.all_reduce(touched_here, group=ranks)
                update.rows = touched_here.nonzero().squeeze(1)
        updates += from_inputs
        for update in updates:  # the gather refuses rows outside the table (on CPU; elsewhere as nn.Embedding does)
            rows = update.rows
            if sharded(update.weight):  # FSDP2, tensor parallelism: the rows this rank's shard holds
                held = self.rules[0].layout.held_rows(update.weight)  # type: ignore[attr-defined]
                rows = rows[(rows >= held.start) & (rows < held.stop)] - held.start
            update.rows = rows = rows if rows.dtype == torch.int64 else rows.long()  # the row writes take int64
            try:
                update.theta = local_tensor(update.weight).index_select(0, rows)
            except IndexError:
                size = update.weight.shape[0]
                bad = int(rows[(rows < 0) | (rows >= size)][0])
                raise ValueError(
                    f"the inputs of {self.capture.name(update.module)} index row {bad} of a table of {size} "
                    "rows; check the inputs handed to step(inputs=...). No parameter was changed"
                ) from None
        return updates

    def _rows_of(self, module: nn.Module, weight: Tensor, touched: dict[Tensor, Tensor], inputs: Inputs) -> Any:
        """The rows of ``weight`` (a dense gradient) to update this step (``None``: update it densely)."""
        rows = touched.get(weight)
        extra = self._rows.take(weight)
        if rows is None and all_zero([weight.grad]):
            return torch.zeros(0, dtype=torch.long, device=weight.device)  # a zero gradient touches no row
        if rows is None:
            inputs.uncaptured(weight)  # (the table falls back to the dense update)
            return None
        if extra is None:
            return rows
        extra = extra.to(rows.device)
        outside = extra[~torch.isin(extra, rows)]
        if outside.numel() and id(module) not in self._warned_extra:
            self._warned_extra.add(id(module))
            name = self.capture.name(module)
            warnings.warn(
                f"LazyAdamW: {outside.numel()} rows of {name}.weight got gradient that no captured call of {name} "
                f"explains (the table is used without calling {name}, for example F.linear(h, {name}.weight)); "
                "those rows are updated too. Finding them reads the whole gradient each backward pass: call the "
                "module instead, or train the table with a dense optimizer",
                CoverageWarning,
                stacklevel=2,
            )
        return torch.unique(torch.cat([rows, outside])) if outside.numel() else rows

    def _update_rows(self, update: _RowUpdate) -> None:
        weight, rows, group, theta = update.weight, update.rows, update.group, update.theta
        state = self.state[weight]
        keys = ("exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if group["amsgrad"] else ()))
        if not state:
            on_device = group.get("fused") or group.get("capturable")
            state["step"] = torch.zeros((), dtype=torch.float32, device=weight.device if on_device else "cpu")
            for key in keys:
                state[key] = torch.zeros_like(weight, memory_format=torch.preserve_format)
        step = state["step"]
        step.add_(_one(step.device, step.dtype))  # a tensor one: adding a Python number costs a scalar tensor
        if rows.numel() == 0:
            return
        tables = [local_tensor(state[key]) for key in keys]
        moments = [table.index_select(0, rows) for table in tables]
        grad = weight.grad
        assert grad is not None and theta is not None
        grad = local_tensor(grad)
        grad_rows = grad.values() if grad.is_sparse else grad.index_select(0, rows)  # (sparse: coalesced, its rows)
        grad_rows = grad_rows.contiguous()  # a sparse gradient's values may be strided
        step = step if step.device == theta.device else step.to(theta.device)
        hyperparameters = {key: group[key] for key in ("amsgrad", "weight_decay", "eps", "maximize")}
        hyperparameters.update(lr=float(group["lr"]), beta1=group["betas"][0], beta2=group["betas"][1])
        fused_adamw_([theta], [grad_rows], moments[:1], moments[1:2], moments[2:], [step], **hyperparameters)
        for table, updated in zip([local_tensor(weight), *tables], [theta, *moments], strict=True):
            _write_rows(table, rows, updated)


class _RowUpdate:
    """One table's update at a step (``rows``: indices into the local shard once gathered, ``theta`` those rows)."""

    __slots__ = ("group", "module", "rows", "theta", "weight")

    def __init__(self, module: nn.Module, weight: Tensor, rows: Tensor, group: dict[str, Any]) -> None:
        self.module, self.weight, self.rows, self.group = module, weight, rows, group
        self.theta: Tensor | None = None


@functools.cache
def _one(device: torch.device, dtype: torch.dtype) -> Tensor:
    return torch.ones((), dtype=dtype, device=device)


_COPY_DTYPES = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _write_rows(table: Tensor, rows: Tensor, values: Tensor) -> None:
    """``table[rows] = values`` (``rows`` unique), bit for bit (a copy moves bits, whatever the element type).

    On CPU, index_put_ splits the copy over threads from a few thousand elements on, where index_copy_
    waits for 32768; and a row write costs per element more than per byte, so the rows move as the widest
    elements (at most 16 bytes) that tile them (a float32 row of 128 as 32 complex128)."""
    if not table.is_cpu:
        table.index_copy_(0, rows, values)
        return
    dtype = table.dtype
    if table.dim() == 2 and table.stride(1) == 1:
        itemsize = table.element_size()
        size = math.gcd(16, table.shape[1] * itemsize, table.stride(0) * itemsize, table.storage_offset() * itemsize)
        dtype = _COPY_DTYPES[size] if size > itemsize else dtype
    table.view(dtype).index_put_((rows,), values.contiguous().view(dtype))
