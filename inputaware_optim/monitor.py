"""``Monitor``: per-module input and per-parameter update statistics of a training run, every ``every`` steps,
computed in the capture's hooks (docs/monitoring.md); the helpers the tools that watch an optimizer share."""

from __future__ import annotations

import contextlib
import csv as _csv
import functools
import json
import math
import numbers
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ._torch import foreach_norm, kernel_skips_step, scaler_handoff
from .base import InputAwareOptimizer
from .capture import Capture, parameter_names, unwrap_model
from .distributed import data_parallel_group
from .inputs import Call, Inputs
from .reduction import Reduction

__all__ = ["MODULE_STATISTICS", "PARAMETER_STATISTICS", "Monitor", "unwrap_optimizer"]

MODULE_STATISTICS = ("mean", "rms", "max_abs", "zero_fraction", "nonfinite")
PARAMETER_STATISTICS = ("grad_norm", "update_norm", "update_to_weight")

# Layout of a module's statistics vector (float64): sums over ranks, then the largest magnitude.
_COUNT, _SUM, _SQUARES, _ZEROS, _NONFINITE, _MAX_ABS = range(6)
_SUMMED = slice(0, 5)
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64}  # _cpu_summary's integer views


def _per_tensor_norms(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Each tensor's 2-norm (0-d, no host sync): one ``foreach_norm`` launch on an accelerator (on CPU, this loop)."""
    if tensors and tensors[0].device.type != "cpu" and all(t.device == tensors[0].device for t in tensors):
        return list(foreach_norm(list(tensors)))
    return [torch.linalg.vector_norm(t) for t in tensors]


def _as_float64(values: Sequence[Tensor], device: Any = None) -> Tensor:
    """0-d tensors as one float64 tensor on ``device`` (default: the first's); one cast where they can share it."""
    if not values:
        return torch.zeros(0, dtype=torch.float64, device=device)
    first = values[0]
    device = first.device if device is None else device
    if all(v.dtype == first.dtype and v.device == first.device for v in values):
        return torch.stack(list(values)).to(device, torch.float64)
    return torch.stack([v.to(device, torch.float64) for v in values])


def _written_norms(tensors: list[Tensor], write: Callable[[int], object]) -> list[Tensor]:
    """``write(i)`` for each tensor, then their 2-norms (on CPU each right after its write, while in cache)."""
    norms = []
    for i, t in enumerate(tensors):
        write(i)
        if t.device.type == "cpu":
            norms.append(torch.linalg.vector_norm(t))
    return norms if len(norms) == len(tensors) else _per_tensor_norms(tensors)


def _params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _dense_values(grad: Tensor) -> Tensor:
    return grad.coalesce().values() if grad.is_sparse else grad


def _after_closure(args: tuple[Any, ...], kwargs: dict[str, Any], then: Callable[[], object]) -> Any:
    """What a step pre-hook returns to run ``then()`` after each call of the step's closure (``None``: no closure)."""
    closure = kwargs["closure"] if "closure" in kwargs else (args[1] if len(args) > 1 else None)
    if closure is None:
        return None

    def closure_then() -> Any:
        loss = closure()
        then()
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then}
    return (args[0], closure_then, *args[2:]), kwargs


def _summary(tensors: Iterable[Any], summarize: Callable[[Tensor], Tensor] | None = None) -> Tensor | None:
    """``[count, sum, sum of squares, zeros, non-finite, max |x|]`` (float64) over the floating-point tensors."""
    total: Tensor | None = None
    for t in tensors:
        if isinstance(t, Tensor) and t.is_floating_point() and t.numel():
            total = _combine(total, (summarize or _summarize)(t))
    return total


def _summarize(t: Tensor) -> Tensor:
    x = t.detach().reshape(-1)
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    return _cpu_summary(x) if x.device.type == "cpu" and x.dtype in _BITS else _device_summary(x)


def _device_summary(x: Tensor) -> Tensor:
    """The summary of flat ``x`` on an accelerator: float64 sums inside the reductions, no host sync."""
    low, high = torch.aminmax(x)
    return torch.stack(
        [
            torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device),
            x.sum(dtype=torch.float64),
            torch.linalg.vector_norm(x, dtype=torch.float64).square(),
            (x == 0).sum().to(torch.float64),
            torch.isfinite(x).logical_not_().sum().to(torch.float64),
            torch.maximum(high, -low).to(torch.float64),
        ]
    )


def _cpu_summary(x: Tensor) -> Tensor:
    """The summary of flat float32/float64 ``x`` on CPU, where ``isfinite``, ``== 0`` and float64 casts
    cost several sums: sums in ``x``'s dtype (in float64 where they overflowed), zeros counted on the
    integer view (exactly where a -0.0 occurs), non-finite values only where the sum is not finite."""
    count = x.numel()
    total = x.sum().item()
    squares = torch.dot(x, x).item()
    bits = x.view(_BITS[x.dtype])
    if bits.amin().item() == torch.iinfo(bits.dtype).min:  # a -0.0
        zeros = int((x == 0).sum())
    else:
        zeros = count - int(torch.count_nonzero(bits))
    nonfinite = 0 if math.isfinite(total) else int(torch.isfinite(x).logical_not_().sum())
    low, high = torch.aminmax(x)
    largest = torch.maximum(high, -low).item()  # NaN where x holds one
    if nonfinite == 0 and not (math.isfinite(total) and math.isfinite(squares)):
        wide = x.double()
        total, squares = wide.sum().item(), torch.dot(wide, wide).item()
    return torch.tensor([count, total, squares, zeros, nonfinite, largest], dtype=torch.float64)


def _combine(a: Tensor | None, b: Tensor) -> Tensor:
    if a is None:
        return b
    return torch.cat([a[_SUMMED] + b[_SUMMED], torch.maximum(a[_MAX_ABS:], b[_MAX_ABS:])])


def _describe(row: Sequence[float]) -> dict[str, float]:
    """The named statistics of one summary vector."""
    count = row[_COUNT]
    if count == 0:
        return {}
    return {
        "mean": row[_SUM] / count,
        "rms": math.sqrt(row[_SQUARES] / count),
        "max_abs": row[_MAX_ABS],
        "zero_fraction": row[_ZEROS] / count,
        "nonfinite": row[_NONFINITE],
    }


_KINDS = ("input", "grad_output")  # the statistics tables' row kinds, in order


def _layer_description(module: nn.Module) -> str:
    """``"Linear 8x4"``: the module's class and the shape of its first parameter."""
    param = next((p for p in module._parameters.values() if p is not None), None)
    shape = "x".join(str(n) for n in param.shape) if param is not None else ""
    return f"{type(module).__name__} {shape}".strip()


class _InputStatistics(Reduction):
    """The summary of each call's floating-point arguments, under the module's trained parameter; a tensor
    summarised earlier in the forward (a block's and its first layer's input) is known by its storage (held
    weakly: a reused address is not mistaken for it), view and version."""

    def __init__(self) -> None:
        self._forward: int | None = None
        self._rows: dict[tuple[Any, ...], tuple[weakref.ref[Any], Tensor]] = {}

    def forward(self, call: Call) -> Any:
        return _summary([*call.args, *call.kwargs.values()], functools.partial(self._once, forward=call.forward))

    def _once(self, t: Tensor, forward: int | None) -> Tensor:
        if forward is None or t.is_inference() or t.is_sparse or type(t) is not Tensor:
            return _summarize(t)  # (no version counter, no plain storage: a DTensor, a subclass, a sparse tensor)
        if forward != self._forward:
            self._forward, self._rows = forward, {}
        key = (t.data_ptr(), t.dtype, t.shape, t.stride(), t._version)
        entry = self._rows.get(key)
        if entry is None or entry[0]() is not t.untyped_storage():
            entry = self._rows[key] = (weakref.ref(t.untyped_storage()), _summarize(t))
        return entry[1]

    combine = staticmethod(_combine)

    def keys(self, module: nn.Module) -> tuple[Tensor, ...]:
        """Its first trained parameter (a frozen weight's gradient never holds a call), else its first."""
        params = [p for p in module._parameters.values() if p is not None]
        return next(((p,) for p in params if p.requires_grad), tuple(params[:1]))


class _GradOutputStatistics(_InputStatistics):
    """The summary of each call's output gradients."""

    grad_outputs = True

    def forward(self, call: Call) -> Any:
        return None

    def backward(self, call: Call, kept: Any) -> Any:
        return _summary(call.grad_outputs if call.has_grad_outputs else ())


class Monitor(contextlib.AbstractContextManager["Monitor"]):
    """Logs input, output-gradient and parameter statistics of a training run, every ``every`` steps.

    Per module (by qualified name): ``input_mean``, ``input_rms``, ``input_max_abs``, ``input_zero_fraction``,
    ``input_nonfinite`` over the floating-point arguments of the calls in its gradient (``grad_output_*`` over output
    gradients, with ``grad_outputs=True``). Per parameter: ``grad_norm`` (before the update), ``update_norm`` and
    ``update_to_weight`` (over the weight's norm before it). Under data parallelism rank 0 writes the whole batch's. It
    lives as long as its optimizer; ``remove()`` (or leaving its ``with`` block) stops it. Steps are numbered from 0
    when it is attached; a resumed run saves ``state_dict()`` with its checkpoint and loads it into the new Monitor
    (``load_state_dict``) to log on at the same numbers and interval.

    Args:
        optimizer: An input-aware optimizer, or any ``torch.optim.Optimizer`` (then give ``model``), or
            a trainer's wrapper of one (Accelerate's ``AcceleratedOptimizer``: the one inside is watched).
        model: The model (or a ``Capture`` of it, cleared after each step) for a plain optimizer.
        every: Log every ``every`` steps, from the first; nothing is computed on the others.
        grad_outputs: Also log statistics of the output gradients.
        tensorboard: A ``torch.utils.tensorboard.SummaryWriter``, or a log folder for one.
        jsonl: A file to append one JSON object per logged step to.
        csv: A file to append ``step,kind,name,statistic,value`` rows to.
        callback: Called with each step's record (a dict, see ``last``).
        grad_scaler: The ``torch.amp.GradScaler`` the loss is scaled by, with ``grad_outputs=True`` (their
            statistics are then those of the unscaled loss); set on the capture it reads, so an input-aware
            optimizer's readers see unscaled output gradients too.

    Under ``DPSGD``/``DPAdamW`` the statistics are of the batch itself (the gradient norm before clipping and
    noise, the inputs): they are not covered by the privacy guarantee, and a ``UserWarning`` says so.

    Attributes:
        last: The latest record: ``{"step": int, "modules": {name: {statistic: value}},
            "parameters": {name: {statistic: value}}, "layers": {name: "Linear 8x4"}}``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | Capture | None = None,
        *,
        every: int = 1,
        grad_outputs: bool = False,
        tensorboard: Any = None,
        jsonl: str | Path | None = None,
        csv: str | Path | None = None,
        callback: Callable[[dict[str, Any]], None] | None = None,
        grad_scaler: Any = None,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Invalid every: {every!r}; it must be a positive integer")
        optimizer = unwrap_optimizer(optimizer)
        _warn_if_private(
            optimizer,
            "Monitor",
            "its statistics (gradient norms before clipping and noise, input statistics) are computed from the "
            "batch itself",
        )
        self.optimizer = optimizer
        self._every = every
        self.last: dict[str, Any] | None = None
        self._reductions: list[Reduction] = [_InputStatistics(), *([_GradOutputStatistics()] if grad_outputs else [])]
        self._own_capture: Capture | None = None
        self._pending: dict[str, Any] | None = None
        self._weights: dict[Tensor, Tensor] = {}  # each parameter before the update (updated in place)
        self._weight_norms: dict[Tensor, Tensor] = {}
        self._plain = not isinstance(optimizer, InputAwareOptimizer)
        self._step = 0  # a plain optimizer's coming step
        self._skipped = False  # GradScaler skips it
        if not self._plain:
            self.capture = optimizer.capture  # type: ignore[attr-defined]
            self._group: Callable[[], Any] = lambda: optimizer.data_parallel_group  # type: ignore[attr-defined]
        else:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"Monitor watches a torch.optim.Optimizer, got {type(optimizer).__name__}")
            if model is None:
                raise TypeError(
                    f"Monitor needs the model to watch a plain {type(optimizer).__name__}: Monitor(optimizer, model)"
                )
            params = {id(p) for p in _params(self.optimizer)}
            if isinstance(model, Capture):
                self.capture = model
            else:
                root = unwrap_model(model)
                owners = [m for m in root.modules() if any(id(p) in params for p in m._parameters.values())]
                self.capture = self._own_capture = Capture(model, owners, keep_calls=False)
            self._group = functools.partial(data_parallel_group, self.capture._model)
        if grad_scaler is not None:
            if self.capture.grad_scaler not in (None, grad_scaler):
                raise ValueError(
                    "Monitor(grad_scaler=...) got another GradScaler than the one its capture (the optimizer's) "
                    "unscales by: pass the one the loss is scaled with to both, or leave the Monitor's out"
                )
            self.capture.grad_scaler = grad_scaler
        group, dist = self._group(), torch.distributed
        writes = group is None or not dist.is_initialized() or dist.get_rank(group) == 0
        self._sinks = _Sinks(tensorboard, jsonl, csv, callback, writes)
        self._finalizer = weakref.finalize(self, self._sinks.close)
        if self._plain:
            self._handles: list[Any] = [
                optimizer.register_step_pre_hook(self._plain_before),
                optimizer.register_step_post_hook(self._plain_after),
            ]
            self._arm()
        else:
            register = optimizer.register_inputs_hook  # type: ignore[attr-defined]
            self._handles = [
                register(self._before_update, when="pre", every=every, reads=self._reductions),
                register(self._after_update, when="post", every=every, reads=None),
            ]

    @property
    def every(self) -> int:
        """How often it logs, in steps (fixed: its hooks are armed for the coming step already)."""
        return self._every

    @every.setter
    def every(self, value: int) -> None:
        raise AttributeError(
            "Monitor.every is fixed at construction (the statistics of the coming step are armed already): "
            "remove() this Monitor and attach a new one with the interval you want"
        )

    def state_dict(self) -> dict[str, int]:
        """``{"step": n}``: the number the coming step will be logged at (for a checkpoint)."""
        return {"step": self._handles[0].coming_step if self._handles and not self._plain else self._step}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Number the coming step ``state_dict["step"]``, as a resumed run continues its log (logging every
        ``every`` steps as if from the start). Call it between steps, before the resumed run's first forward.

        Raises:
            ValueError: If the step is not an integer >= 0.
            RuntimeError: If a backward ran since the last step (its step was numbered already).
        """
        step = _loaded_step(state_dict, "Monitor")
        if not self._handles:
            raise RuntimeError("Monitor.load_state_dict: this Monitor was removed; attach a new one and load into it")
        if self._plain:
            if self.capture.holds():
                raise RuntimeError(
                    "Monitor.load_state_dict between steps: this step's backward has run already. Load it after "
                    "optimizer.step() (or zero_grad()), before the next forward"
                )
            self._step = step
            self._arm()
        else:
            for handle in self._handles:
                handle.coming_step = step

    def _arm(self) -> None:
        """Compute the statistics in the hooks exactly for the steps that log them."""
        arm = self.capture.add_reduction if self._step % self.every == 0 else self.capture.remove_reduction
        for reduction in self._reductions:
            arm(reduction)

    def _plain_before(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._step % self.every:
            return None
        if kernel_skips_step(optimizer):  # (fused, under GradScaler: skipped, as it skips any other optimizer's)
            self._skipped = True
            return None
        wrapped = _after_closure(args, kwargs, lambda: self._read(self.capture.reduced))
        if wrapped is None:
            self._before_update(optimizer, None)
        else:  # the gradient exists once the closure ran (LBFGS runs it several times: the last is logged)
            self._keep_weights([p for p in _params(self.optimizer) if p.requires_grad])
        return wrapped

    def _plain_after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        skipped, self._skipped = self._skipped, False
        try:
            if self._step % self.every == 0 and not skipped:
                self._after_update(optimizer, None, None)
        finally:
            self.capture.clear()  # the step consumed what it read, as an input-aware optimizer's step does
            self._step += 0 if skipped else 1
            self._arm()

    @torch.no_grad()
    def _before_update(self, optimizer: Any, inputs: Inputs | None) -> None:
        self._read(inputs.reduced if inputs is not None else self.capture.reduced)
        self._keep_weights(self._pending["params"] if self._pending is not None else [])

    @torch.no_grad()
    def _read(self, reduced: Callable[[Reduction], dict[Tensor, Any]]) -> None:
        """The module statistics (summed over ranks) and the gradient norms, as tensors (no host sync)."""
        # The same rows on every rank, whichever modules each one called: the reduction lines up.
        keys = list(dict.fromkeys(k for m in self.capture.modules for k in self._reductions[0].keys(m)))
        tables = [reduced(reduction) for reduction in self._reductions]
        first = next((row for got in tables for row in got.values() if row is not None), None)
        empty = torch.zeros(6, dtype=torch.float64, device=first.device if first is not None else None)
        rows = [empty if got.get(key) is None else got[key] for got in tables for key in keys]
        table = torch.stack(rows) if rows else empty.reshape(0, 6)
        _all_reduce_statistics(table, self._group())
        grads = {p: p.grad for p in _params(self.optimizer) if p.grad is not None}
        grad_norms = _as_float64(_per_tensor_norms([_dense_values(g) for g in grads.values()]))
        grad_scale = scaler_handoff(self.optimizer)[0]  # (a fused kernel unscales them in the step, after this)
        if grad_scale is not None:
            grad_norms = grad_norms / grad_scale.to(grad_norms.device, torch.float64)
        named = {param: name for param, (name, _) in parameter_names(self.capture.root).items()}  # as named now
        self._pending = {
            "names": named,
            "rows": [(self._module_name(k, named), kind) for kind in _KINDS[: len(tables)] for k in keys],
            "table": table,
            "params": list(grads),
            "grad_norms": grad_norms,
            "layers": self._layers(keys, named),
        }

    def _layers(self, keys: list[Tensor], named: dict[Tensor, str]) -> dict[str, str]:
        """Each logged module's class and shape (``"Linear 8x4"``), by the name its rows carry."""
        owners = {key: self.capture.owners(key) for key in keys}
        return {self._module_name(k, named): _layer_description(found[0]) for k, found in owners.items() if found}

    def _keep_weights(self, params: list[Tensor]) -> None:
        """Copy the weights before the update into buffers kept across logged steps, and take their norms."""
        weights = self._weights
        for p in params:
            kept = weights.get(p)
            if kept is None or kept.shape != p.shape or kept.dtype != p.dtype or kept.device != p.device:
                weights[p] = torch.empty_like(p.detach())
        copies = [weights[p] for p in params]
        norms = _written_norms(copies, lambda i: copies[i].copy_(params[i].detach()))
        self._weight_norms = dict(zip(params, norms, strict=True))

    def _module_name(self, param: Tensor, named: dict[Tensor, str]) -> str:
        return " + ".join(self.capture.name(m) for m in self.capture.owners(param)) or named.get(param, "?")

    @torch.no_grad()
    def _after_update(self, optimizer: Any, inputs: Any, updates: Any) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        params = pending["params"]
        # (a parameter that got its gradient after the weights were kept has no copy: zero)
        changes = [self._weights[p] if p in self._weights else torch.zeros_like(p.detach()) for p in params]
        weight_norms = [self._weight_norms.get(p, p.new_zeros(())) for p in params]
        change_norms = _written_norms(changes, lambda i: changes[i].sub_(params[i].detach()))
        table = pending["table"]
        norms = [pending["grad_norms"].to(table.device), _as_float64([*weight_norms, *change_norms], table.device)]
        flat = torch.cat([table.reshape(-1), *norms]).tolist()  # the one host synchronization of a logged step
        if self.every > 1:
            self._weights.clear()
        self._weight_norms = {}
        step = self._step if self._plain else self._handles[0].step
        record: dict[str, Any] = {"step": step, "modules": {}, "parameters": {}, "layers": pending["layers"]}
        for index, (name, kind) in enumerate(pending["rows"]):
            described = _describe(flat[index * 6 : (index + 1) * 6])
            if described:  # (a module no call of this step reached has no statistics)
                record["modules"].setdefault(name, {}).update({f"{kind}_{k}": v for k, v in described.items()})
        offset, n = len(pending["rows"]) * 6, len(params)
        for i, param in enumerate(params):
            grad_norm, weight_norm, update_norm = flat[offset + i], flat[offset + n + i], flat[offset + 2 * n + i]
            ratio = update_norm / weight_norm if weight_norm > 0 else (0.0 if update_norm == 0 else math.inf)
            name = pending["names"].get(param, f"param{i}")
            record["parameters"][name] = {"grad_norm": grad_norm, "update_norm": update_norm, "update_to_weight": ratio}
        self.last = record
        self._sinks.write(record)

    def flush(self) -> None:
        """Flush the file and TensorBoard sinks."""
        self._sinks.flush()

    def remove(self) -> None:
        """Stop monitoring: take the hooks off and close the sinks this monitor opened."""
        if self._handles and not self._plain:
            self._step = self._handles[0].coming_step  # (state_dict() still says where it stopped)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._plain:
            for reduction in self._reductions:
                self.capture.remove_reduction(reduction)
        if self._own_capture is not None:
            self._own_capture.remove()
        self._weights.clear()
        self._finalizer()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise _not_copied("Monitor", "Monitor(copied_optimizer, ...).load_state_dict(monitor.state_dict())")


class _Sinks:
    """Where records go: TensorBoard, JSON lines, CSV and a callback (only on the writing rank)."""

    def __init__(self, tensorboard: Any, jsonl: Any, csv: Any, callback: Any, writes: bool) -> None:
        self.callback = callback if writes else None
        self.writer = tensorboard if writes else None
        self.own_writer = isinstance(self.writer, (str, Path))
        if self.own_writer:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ImportError(
                    "Monitor(tensorboard=...) needs the tensorboard package: pip install 'inputaware_optim[monitor]'"
                ) from error
            self.writer = SummaryWriter(str(tensorboard))
        self.jsonl = open(jsonl, "a") if writes and jsonl is not None else None  # noqa: SIM115 - open till close()
        self.csv = open(csv, "a", newline="") if writes and csv is not None else None  # noqa: SIM115
        if self.csv is not None and self.csv.tell() == 0:
            _csv.writer(self.csv).writerow(["step", "kind", "name", "statistic", "value"])

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        rows = [
            (kind, name, statistic, value)
            for kind, table in (("module", record["modules"]), ("parameter", record["parameters"]))
            for name, statistics in table.items()
            for statistic, value in statistics.items()
        ]
        if self.writer is not None:
            for _, name, statistic, value in rows:
                self.writer.add_scalar(f"{statistic}/{name}", value, step)
        # Flushed at each record: a run that dies (say, of a NaN) keeps its log.
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        if self.csv is not None:
            _csv.writer(self.csv).writerows([(step, *row) for row in rows])
            self.csv.flush()
        if self.callback is not None:
            self.callback(record)

    def flush(self) -> None:
        for sink in (self.writer, self.jsonl, self.csv):
            if sink is not None:
                sink.flush()

    def close(self) -> None:
        self.flush()
        for sink in (self.jsonl, self.csv, self.writer if self.own_writer else None):
            if sink is not None:
                sink.close()
        self.jsonl = self.csv = None
        self.writer = None if self.own_writer else self.writer


def _loaded_step(state_dict: Any, tool: str) -> int:
    """The step of ``{"step": n}``: any integral ``n >= 0``, as checkpoints hold it (a NumPy integer, a 0-d integer
    tensor), as an ``int``; a bool, a float or a negative number is refused."""
    step = state_dict.get("step") if isinstance(state_dict, dict) else None
    if isinstance(step, Tensor) and step.dim() == 0:
        step = step.item()  # (a float, complex or bool tensor gives a float, complex or bool: refused below)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:  # (NumPy's bool is no Integral)
        raise ValueError(f"{tool}.load_state_dict takes {{'step': n}} with n an integer >= 0, got {state_dict!r}")
    return int(step)


def _not_copied(tool: str, recipe: str) -> TypeError:
    """Why a tool attached to an optimizer is not copied (``copy``, ``deepcopy``, ``pickle``), and what to do."""
    return TypeError(
        f"a {tool} attached to an optimizer cannot be copied or pickled: it works through hooks on that optimizer "
        "(and its model), and a copy of the optimizer is built without them (as torch's copies drop their step "
        f"hooks), so the copy would silently do nothing. Copy (or checkpoint) the model and the optimizer, then "
        f"attach a new {tool} to the copy and load this one's state: {recipe}. To checkpoint it, save its "
        "state_dict()"
    )


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer under a trainer's wrappers (Accelerate's ``AcceleratedOptimizer``: ``.optimizer``)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _warn_if_private(optimizer: Any, tool: str, what: str) -> None:
    """Say that ``tool`` on a DP optimizer reads the batch outside the privacy guarantee."""
    if any(rule.private for rule in getattr(optimizer, "rules", ())):  # DPSGD, DPAdamW, PerSampleClipping
        warnings.warn(
            f"{tool} on {type(optimizer).__name__}: {what}, which the privacy guarantee does not cover; keep "
            "them out of anything released",
            UserWarning,
            stacklevel=3,
        )


def _all_reduce_statistics(table: Tensor, group: Any) -> None:
    """Sum the summed columns of ``table`` and take the largest of the max-abs one over ``group``'s ranks, in place."""
    if group is not None and torch.distributed.is_initialized():
        dist = torch.distributed
        summed, largest = table[:, _SUMMED].contiguous(), table[:, _MAX_ABS].contiguous()
        dist.all_reduce(summed, group=group)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        table[:, _SUMMED], table[:, _MAX_ABS] = summed, largest
