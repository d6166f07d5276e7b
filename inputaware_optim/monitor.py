"""See inside training from the optimizer's seat: ``Monitor`` and ``NonFiniteFinder``.

``Monitor`` logs, every ``every`` steps, per watched module the mean, RMS, largest magnitude,
fraction of exact zeros and count of non-finite values of its inputs (and of its output
gradients, with ``grad_outputs=True``), and per parameter the gradient norm, the update norm
and the update-to-weight ratio. The module statistics are a ``Reduction``: computed in the
hooks, summed over the calls in each parameter's gradient, and no input is kept; on steps
``every`` skips nothing is computed at all. Under data parallelism they are summed over the
ranks, so every rank holds the statistics of the whole batch (output gradients: those of each
rank's own loss); rank 0 writes them to the sinks (a TensorBoard ``SummaryWriter``, JSON lines,
CSV, a callback).

``NonFiniteFinder`` names, when a step's gradient is not finite, the first module call whose
inputs were finite and whose output was not (forward), or else the first, in backward order,
whose output gradient was finite and whose input gradient was not.

``python -m inputaware_optim plot LOG.jsonl -o out.png`` draws a JSON-lines log as per-layer
heatmaps over steps.
"""

from __future__ import annotations

import csv as _csv
import functools
import json
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from .capture import Capture, unwrap_model
from .distributed import data_parallel_group
from .hooks import StepHooks
from .inputs import Call, Inputs
from .reduction import Reduction

__all__ = [
    "MODULE_STATISTICS",
    "PARAMETER_STATISTICS",
    "Monitor",
    "NonFiniteError",
    "NonFiniteFinder",
    "NonFiniteOrigin",
    "NonFiniteWarning",
    "plot",
]

MODULE_STATISTICS = ("mean", "rms", "max_abs", "zero_fraction", "nonfinite")
PARAMETER_STATISTICS = ("grad_norm", "update_norm", "update_to_weight")

# Layout of a module's statistics vector (float64): sums over ranks, then the largest magnitude.
_COUNT, _SUM, _SQUARES, _ZEROS, _NONFINITE, _MAX_ABS = range(6)
_SUMMED = slice(0, 5)


def _summary(tensors: Iterable[Any]) -> Tensor | None:
    """``[count, sum, sum of squares, zeros, non-finite, max |x|]`` (float64) over the floating-point tensors."""
    total: Tensor | None = None
    for t in tensors:
        if not isinstance(t, Tensor) or not t.is_floating_point() or t.numel() == 0:
            continue
        x = t.detach().reshape(-1)
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.float()
        row = _cpu_summary(x) if x.device.type == "cpu" and x.dtype in _BITS else _device_summary(x)
        total = row if total is None else _combine(total, row)
    return total


def _device_summary(x: Tensor) -> Tensor:
    """The summary of flat ``x`` on an accelerator: plain counts, no host synchronization."""
    low, high = torch.aminmax(x)
    return torch.stack(
        [
            x.new_full((), float(x.numel())),
            x.sum(),
            torch.dot(x, x),
            (x == 0).sum().to(x.dtype),
            torch.isfinite(x).logical_not_().sum().to(x.dtype),
            torch.maximum(high, -low),
        ]
    ).double()


_BITS = {torch.float32: torch.int32, torch.float64: torch.int64}


def _cpu_summary(x: Tensor) -> Tensor:
    """The summary of flat float32/float64 ``x`` on CPU, where reading a value is free and ``isfinite``,
    ``== 0`` and ``count_nonzero`` on floats are several times slower than a sum.

    +0.0 is the only float whose bits are all zero: zeros are counted on the integer view, and
    exactly only where its smallest value says there is a -0.0 (the most negative integer).
    Non-finite values are counted only where the sum, NaN or infinite whenever one is, says so.
    """
    count = x.numel()
    total = x.sum().item()
    bits = x.view(_BITS[x.dtype])
    if bits.amin().item() == torch.iinfo(bits.dtype).min:  # a -0.0
        zeros = int((x == 0).sum())
    else:
        zeros = count - int(torch.count_nonzero(bits))
    nonfinite = 0 if math.isfinite(total) else int(torch.isfinite(x).logical_not_().sum())
    largest = torch.maximum(x.amax(), -x.amin()).item()  # NaN where x holds one (two passes beat aminmax here)
    squares = torch.dot(x, x).item()
    return torch.tensor([count, total, squares, zeros, nonfinite, largest], dtype=torch.float64)


def _combine(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    return torch.cat([a[_SUMMED] + b[_SUMMED], torch.maximum(a[_MAX_ABS:], b[_MAX_ABS:])])


def _describe(row: Sequence[float]) -> dict[str, float]:
    """The named statistics of one summary vector."""
    count = row[_COUNT]
    if count == 0:
        return {}
    return {
        "mean": row[_SUM] / count,
        "rms": math.sqrt(row[_SQUARES] / count) if row[_SQUARES] >= 0 else math.nan,
        "max_abs": row[_MAX_ABS],
        "zero_fraction": row[_ZEROS] / count,
        "nonfinite": row[_NONFINITE],
    }


class _InputStatistics(Reduction):
    """The summary of each call's floating-point arguments, kept under the module's first parameter."""

    def forward(self, call: Call) -> Any:
        return _summary([*call.args, *call.kwargs.values()])

    def combine(self, a: Any, b: Any) -> Any:
        return _combine(a, b)

    def keys(self, module: nn.Module) -> tuple[Tensor, ...]:
        first = next((p for p in module._parameters.values() if p is not None), None)
        return () if first is None else (first,)


class _GradOutputStatistics(_InputStatistics):
    """The summary of each call's output gradients."""

    grad_outputs = True

    def forward(self, call: Call) -> Any:
        return None

    def backward(self, call: Call, kept: Any) -> Any:
        return _summary(call.grad_outputs or ())


class Monitor:
    """Logs input, output-gradient and parameter statistics of a training run, every ``every`` steps.

    Per module (keyed by its qualified name): ``input_mean``, ``input_rms``, ``input_max_abs``,
    ``input_zero_fraction``, ``input_nonfinite`` over every floating-point argument of the calls
    in its gradient (``grad_output_*`` the same over output gradients, with ``grad_outputs=True``).
    Per parameter: ``grad_norm`` (before the update), ``update_norm`` and ``update_to_weight``
    (the update's norm over the weight's norm before it).

    Args:
        optimizer: An input-aware optimizer, or any ``torch.optim.Optimizer`` (then give ``model``).
        model: The model (or a ``Capture`` of it) for a plain ``torch.optim`` optimizer; its modules
            that own an optimized parameter are watched. The capture is cleared after each step, as
            an input-aware optimizer's step does. Torch runs a plain optimizer's step hooks before
            its closure: step with a closure through an input-aware optimizer instead.
        every: Log every ``every`` steps, from the first; nothing is computed on the others.
        grad_outputs: Also log statistics of the output gradients.
        tensorboard: A ``torch.utils.tensorboard.SummaryWriter``, or a log folder for one.
        jsonl: A file to append one JSON object per logged step to.
        csv: A file to append ``step,kind,name,statistic,value`` rows to.
        callback: Called with each step's record (a dict, see ``last``).

    Attributes:
        last: The latest record: ``{"step": int, "modules": {name: {statistic: value}},
            "parameters": {name: {statistic: value}}}``.
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
    ) -> None:
        from .base import InputAwareOptimizer

        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Invalid every: {every!r}; it must be a positive integer")
        self.optimizer = optimizer
        self.every = every
        self.last: dict[str, Any] | None = None
        self._reductions: list[Reduction] = [_InputStatistics()]
        if grad_outputs:
            self._reductions.append(_GradOutputStatistics())
        self._removers: list[Callable[[], None]] = []
        self._own_capture: Capture | None = None
        if isinstance(optimizer, InputAwareOptimizer):
            self.capture = optimizer.capture
            group: Callable[[], Any] = lambda: optimizer.data_parallel_group  # noqa: E731 - read when logging
            register = optimizer.register_inputs_hook
        else:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"Monitor watches a torch.optim.Optimizer, got {type(optimizer).__name__}")
            if model is None:
                raise TypeError(
                    f"Monitor needs the model to watch a plain {type(optimizer).__name__}: Monitor(optimizer, model)"
                )
            params = {id(p) for g in optimizer.param_groups for p in g["params"]}
            if isinstance(model, Capture):
                self.capture = model
            else:
                root = unwrap_model(model)
                owners = [m for m in root.modules() if any(id(p) in params for p in m._parameters.values())]
                self.capture = self._own_capture = Capture(model, owners, keep_calls=False)
            model = self.capture._model
            group = lambda: data_parallel_group(model)  # noqa: E731
            register = _plain_optimizer_hooks(optimizer, self.capture, self._removers)
        self._group = group
        root = self.capture._root
        self._param_names: dict[Tensor, str] = {}
        for name, param in root.named_parameters(remove_duplicate=False):
            self._param_names.setdefault(param, name)
        self._sinks = _Sinks(tensorboard, jsonl, csv, callback, self._writes(group()))
        self._pending: dict[str, Any] | None = None
        self._pre = register(self._before_update, when="pre", every=every, reads=self._reductions)
        self._post = register(self._after_update, when="post", every=every, reads="updates")
        self._removers[:0] = [self._pre.remove, self._post.remove]

    @staticmethod
    def _writes(group: Any) -> bool:
        dist = torch.distributed
        return group is None or not dist.is_initialized() or dist.get_rank(group) == 0

    def _params(self) -> list[Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    @torch.no_grad()
    def _before_update(self, optimizer: Any, inputs: Inputs) -> None:
        # The same rows on every rank, whichever modules each one called: the reduction lines up.
        keys = list(dict.fromkeys(k for m in self.capture.modules for k in self._reductions[0].keys(m)))
        names, rows, kinds = [], [], []
        empty = torch.zeros(6, dtype=torch.float64)
        for kind, reduction in zip(("input", "grad_output"), self._reductions, strict=False):
            reduced = inputs.reduced(reduction)
            for key in keys:
                row = reduced.get(key)
                names.append(self._module_name(key))
                kinds.append(kind)
                rows.append(empty if row is None else row)
        table = torch.stack(rows) if rows else empty.reshape(0, 6)
        group = self._group()
        if group is not None and torch.distributed.is_initialized():
            _all_reduce_statistics(table, group)
        grads = {p: p.grad for p in self._params() if p.grad is not None}
        params = list(grads)
        norms = _norms([_dense_values(g) for g in grads.values()] + [p.detach() for p in params])
        self._pending = {"names": names, "kinds": kinds, "table": table, "params": params, "norms": norms}

    def _module_name(self, param: Tensor) -> str:
        return " + ".join(self.capture.name(m) for m in self.capture.owners(param)) or self._param_names.get(param, "?")

    @torch.no_grad()
    def _after_update(self, optimizer: Any, inputs: Inputs, updates: dict[Tensor, Tensor] | None) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        params = pending["params"]
        updates = updates or {}
        changes = _norms([updates[p] if p in updates else p.new_zeros(()) for p in params])
        table = pending["table"]
        values = torch.cat([table.reshape(-1), pending["norms"].to(table.device), changes.to(table.device)])
        flat = values.tolist()  # the one host synchronization of a logged step
        width, count = 6, len(pending["names"])
        record: dict[str, Any] = {"step": self._pre.step, "modules": {}, "parameters": {}}
        for index, (name, kind) in enumerate(zip(pending["names"], pending["kinds"], strict=True)):
            described = _describe(flat[index * width : (index + 1) * width])
            entry = record["modules"].setdefault(name, {})
            entry.update({f"{kind}_{k}": v for k, v in described.items()})
        offset, n = count * width, len(params)
        for i, param in enumerate(params):
            grad_norm, weight_norm, update_norm = flat[offset + i], flat[offset + n + i], flat[offset + 2 * n + i]
            ratio = update_norm / weight_norm if weight_norm > 0 else (0.0 if update_norm == 0 else math.inf)
            record["parameters"][self._param_names.get(param, f"param{i}")] = {
                "grad_norm": grad_norm,
                "update_norm": update_norm,
                "update_to_weight": ratio,
            }
        self.last = record
        self._sinks.write(record)

    def flush(self) -> None:
        """Flush the file and TensorBoard sinks."""
        self._sinks.flush()

    def remove(self) -> None:
        """Stop monitoring: take the hooks off and close the sinks this monitor opened."""
        for remove in self._removers:
            remove()
        self._removers.clear()
        if self._own_capture is not None:
            self._own_capture.remove()
        self._sinks.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _norms(tensors: list[Tensor]) -> Tensor:
    """The 2-norm of each tensor, as one float64 tensor."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    norms = torch._foreach_norm(tensors)
    device = norms[0].device
    return torch.stack([n.to(device, torch.float64) for n in norms])


def _dense_values(grad: Tensor) -> Tensor:
    return grad.coalesce()._values() if grad.is_sparse else grad


def _all_reduce_statistics(table: Tensor, group: Any) -> None:
    """Sum the counts and sums over the ranks, and take the largest magnitude (in place)."""
    dist = torch.distributed
    summed = table[:, _SUMMED].contiguous()
    largest = table[:, _MAX_ABS].contiguous()
    dist.all_reduce(summed, group=group)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    table[:, _SUMMED] = summed
    table[:, _MAX_ABS] = largest


def _plain_optimizer_hooks(
    optimizer: torch.optim.Optimizer, capture: Capture, removers: list[Callable[[], None]]
) -> Callable[..., Any]:
    """``register_inputs_hook`` for a plain ``torch.optim`` optimizer, driven by its own step hooks."""
    registry = StepHooks(capture, lambda: [p for g in optimizer.param_groups for p in g["params"]])
    state: dict[str, Inputs | None] = {"inputs": None}

    def before(opt: Any, args: Any, kwargs: Any) -> None:
        if registry.due():
            inputs = state["inputs"] = capture.inputs()
            registry.before_step(opt, inputs)

    def after(opt: Any, args: Any, kwargs: Any) -> None:
        inputs, state["inputs"] = state["inputs"], None
        if inputs is not None:
            registry.after_step(opt, inputs)
        capture.clear()  # the step consumed what it read, as an input-aware optimizer's step does
        registry.advance()

    removers.append(optimizer.register_step_pre_hook(before).remove)
    removers.append(optimizer.register_step_post_hook(after).remove)
    return registry.register


class _Sinks:
    """Where records go: TensorBoard, JSON lines, CSV and a callback (only on the writing rank)."""

    def __init__(self, tensorboard: Any, jsonl: Any, csv: Any, callback: Any, writes: bool) -> None:
        self.writes = writes
        self.callback = callback
        self.writer: Any = None
        self.own_writer = False
        self.jsonl: Any = None
        self.csv: Any = None
        self.csv_writer: Any = None
        if not writes:
            return
        if isinstance(tensorboard, (str, Path)):
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ImportError(
                    "Monitor(tensorboard=...) needs the tensorboard package: pip install 'inputaware_optim[monitor]'"
                ) from error
            self.writer, self.own_writer = SummaryWriter(str(tensorboard)), True
        else:
            self.writer = tensorboard
        if jsonl is not None:
            self.jsonl = open(jsonl, "a")  # noqa: SIM115 - open for the monitor's lifetime
        if csv is not None:
            new = not Path(csv).exists() or Path(csv).stat().st_size == 0
            self.csv = open(csv, "a", newline="")  # noqa: SIM115
            self.csv_writer = _csv.writer(self.csv)
            if new:
                self.csv_writer.writerow(["step", "kind", "name", "statistic", "value"])

    def write(self, record: dict[str, Any]) -> None:
        if not self.writes:
            return
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
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()  # a run that dies (say, of a NaN) keeps its log
        if self.csv_writer is not None:
            self.csv_writer.writerows([(step, *row) for row in rows])
            self.csv.flush()
        if self.callback is not None:
            self.callback(record)

    def flush(self) -> None:
        for sink in (self.writer, self.jsonl, self.csv):
            if sink is not None:
                sink.flush()

    def close(self) -> None:
        self.flush()
        for sink in (self.jsonl, self.csv):
            if sink is not None:
                sink.close()
        if self.own_writer:
            self.writer.close()
        self.jsonl = self.csv = self.csv_writer = None
        if self.own_writer:
            self.writer = None


# -- the first non-finite value ---------------------------------------------------------------


class NonFiniteWarning(UserWarning):
    """A step's gradient was not finite; the message names where the first non-finite value arose."""


class NonFiniteError(FloatingPointError):
    """Raised instead of ``NonFiniteWarning`` by a ``NonFiniteFinder(action="raise")``; the step is not taken."""

    def __init__(self, message: str, origin: NonFiniteOrigin | None) -> None:
        super().__init__(message)
        self.origin = origin


@dataclass(frozen=True)
class NonFiniteOrigin:
    """Where a step's first non-finite value arose.

    Attributes:
        module: The qualified name of the module (``""`` when no module produced it: the loss).
        call: Which call of that module in the step (0 for its first).
        step: The step (counted from 0 when the finder was attached).
        phase: ``"forward"`` (inputs finite, output not); ``"input"`` (no module made it: the
            first call with a non-finite input got it from the data or from code outside modules);
            ``"backward"`` (output gradient finite, the gradient it passed to its inputs or its
            parameters not); ``"loss"`` (every module's output was finite, the gradient reaching
            the model's output was not).
    """

    module: str
    call: int
    step: int
    phase: Literal["forward", "input", "backward", "loss"]

    def describe(self) -> str:
        if self.phase == "forward":
            what = "in the forward: its inputs were finite, its output was not"
        elif self.phase == "input":
            what = "got a non-finite input from the data or from code outside modules (no module made one)"
        elif self.phase == "backward":
            what = "in the backward: the gradient reaching its output was finite, the gradient it produced was not"
        else:
            return f"step {self.step}: every module's output was finite; the gradient of the loss was not"
        return f"step {self.step}: {self.module} (call {self.call}) {what}"


class _Check:
    """One module call: sums of its inputs, outputs and their gradients (0-d tensors, no sync)."""

    __slots__ = ("backward", "call", "grad_inputs", "grad_outputs", "inputs", "module", "outputs")

    def __init__(self, module: nn.Module, call: int) -> None:
        self.module = module
        self.call = call
        self.inputs: list[Tensor] = []
        self.outputs: list[Tensor] = []
        self.grad_outputs: list[Tensor] = []
        self.grad_inputs: list[Tensor] = []
        self.backward: int | None = None  # when its output gradient arrived, in backward order


def _sums(tensors: Iterable[Any], into: list[Tensor]) -> None:
    """Append a 0-d tensor per floating-point tensor that is finite iff the tensor is (its sum: one pass)."""
    for t in tensors:
        if isinstance(t, Tensor) and t.is_floating_point() and t.numel():
            into.append(t.detach().sum(dtype=torch.float32))


def _finite(values: list[Tensor]) -> bool:
    """Whether every 0-d tensor in ``values`` is finite (one host synchronization)."""
    if not values:
        return True
    first = values[0]
    return bool(torch.isfinite(torch.stack([v.to(first.device, torch.float32) for v in values])).all())


# Calls kept between two steps at most (forwards that never reach a step, say in evaluation with
# grad enabled, stop adding once there are this many; the first non-finite value is in the first).
_MAX_CHECKS = 100_000


class NonFiniteFinder:
    """Names where a step's first non-finite value arose, when its gradient is not finite.

    Every module of the model gets a forward hook that keeps the float32 sum of each of the
    call's inputs and outputs (non-finite exactly when the tensor is, or when the sum overflows
    float32), and tensor hooks that keep those of their gradients: 0-d tensors, with no host
    synchronization in the hooks. At each step one check of the gradients decides; only a
    non-finite step is inspected: the first call in forward order whose inputs were finite and
    whose output was not; else the first whose input was not (the data, or code outside
    modules); else the first in backward order whose output gradient was finite and whose input
    gradient (or own parameter's gradient) was not, innermost module first.
    Where a tensor feeds several modules its gradient is their sum, so the first of them in
    backward order is named.

    Args:
        optimizer: An input-aware optimizer, or any ``torch.optim.Optimizer`` (then give ``model``).
        model: The model, for a plain ``torch.optim`` optimizer (default: the optimizer's).
        action: ``"warn"`` (a ``NonFiniteWarning``) or ``"raise"`` (a ``NonFiniteError`` before the
            update, so the step is not taken).

    Attributes:
        found: The latest ``NonFiniteOrigin`` found (``None`` until a step is not finite).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | None = None,
        *,
        action: Literal["warn", "raise"] = "warn",
    ) -> None:
        from .base import InputAwareOptimizer

        if action not in ("warn", "raise"):
            raise ValueError(f"Invalid action: {action!r}; choose 'warn' or 'raise'")
        if model is None:
            if not isinstance(optimizer, InputAwareOptimizer):
                raise TypeError(
                    f"NonFiniteFinder needs the model to watch a plain {type(optimizer).__name__}: "
                    "NonFiniteFinder(optimizer, model)"
                )
            model = optimizer.model
        self.optimizer = optimizer
        self.action = action
        self.found: NonFiniteOrigin | None = None
        self.step = 0
        root = unwrap_model(model)
        self._names: dict[nn.Module, str] = {}
        for name, module in root.named_modules(remove_duplicate=False):
            self._names.setdefault(module, name or type(root).__name__)
        self._inside = {m: {id(s) for s in m.modules()} for m in self._names}
        self._checks: list[_Check] = []
        self._counts: dict[nn.Module, int] = {}
        self._arrivals = 0
        self._seen: dict[int, tuple[weakref.ref[Tensor], int, Tensor]] = {}
        self._waiting: dict[int, tuple[weakref.ref[Tensor], list[tuple[_Check, bool]]]] = {}
        self._handles: list[Any] = [m.register_forward_hook(self._record, with_kwargs=True) for m in self._names]
        if isinstance(optimizer, InputAwareOptimizer):
            self._handles.append(optimizer.register_inputs_hook(lambda opt, inputs: self._check(), reads=None))
        else:
            self._handles.append(optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._check()))

    # -- hooks ------------------------------------------------------------------------------
    def _record(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or len(self._checks) >= _MAX_CHECKS:
            return
        call = self._counts.get(module, 0)
        self._counts[module] = call + 1
        check = _Check(module, call)
        inputs = args if not kwargs else (*args, *kwargs.values())
        outputs = [output] if type(output) is Tensor else tree_flatten(output)[0]
        self._checks.append(check)
        for tensors, sums, is_output in ((inputs, check.inputs, False), (outputs, check.outputs, True)):
            for t in tensors:
                if isinstance(t, Tensor) and t.is_floating_point() and t.numel():
                    sums.append(self._sum_of(t))
                    if t.requires_grad:
                        self._listen(t, check, is_output)

    # One module's output is usually the next one's input: each tensor is summed, and its
    # gradient hooked, once (by identity, for the step), and shared by the calls that see it.
    def _sum_of(self, t: Tensor) -> Tensor:
        seen = self._seen.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:  # not changed in place since
            return seen[2]
        total = t.detach().sum(dtype=torch.float32)
        self._seen[id(t)] = (weakref.ref(t), t._version, total)
        return total

    def _listen(self, t: Tensor, check: _Check, is_output: bool) -> None:
        waiting = self._waiting.get(id(t))
        if waiting is None or waiting[0]() is not t:
            waiting = (weakref.ref(t), [])
            self._waiting[id(t)] = waiting
            t.register_hook(functools.partial(self._gradient, waiting[1]))
        waiting[1].append((check, is_output))

    def _gradient(self, listeners: list[tuple[_Check, bool]], grad: Tensor) -> None:
        total = grad.detach().sum(dtype=torch.float32)
        for check, is_output in listeners:
            if not is_output:
                check.grad_inputs.append(total)
                continue
            if check.backward is None:
                check.backward = self._arrivals
                self._arrivals += 1
            check.grad_outputs.append(total)

    # -- the step ---------------------------------------------------------------------------
    def _check(self) -> None:
        try:
            grads = [
                _dense_values(p.grad) for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None
            ]
            # One fused call; on CPU the norm accumulates in double, so only a non-finite value makes it so.
            if not grads or _finite(list(torch._foreach_norm(grads))):
                return
            origin = self._origin()
            self.found = origin
            message = "the gradient is not finite; " + (
                origin.describe()
                if origin
                else f"step {self.step}: no module call of this process explains it (under data parallelism, "
                "another rank's report names it)"
            )
            if self.action == "raise":
                raise NonFiniteError(message, origin)
            warnings.warn(message, NonFiniteWarning, stacklevel=2)
        finally:
            self._checks = []
            self._counts = {}
            self._seen = {}
            self._waiting = {}
            self._arrivals = 0
            self.step += 1

    def _origin(self) -> NonFiniteOrigin | None:
        checks = self._checks
        for check in checks:
            if _finite(check.inputs) and not _finite(check.outputs):
                return NonFiniteOrigin(self._names[check.module], check.call, self.step, "forward")
        for check in checks:  # no module made it: it came in with the data, or from code outside modules
            if not _finite(check.inputs):
                return NonFiniteOrigin(self._names[check.module], check.call, self.step, "input")
        arrived = sorted((c for c in checks if c.backward is not None), key=lambda c: c.backward or 0)
        # A parameter's gradient sums over the module's calls: it names the module only where the
        # gradient reaching every one of its calls was finite.
        clean = {c.module for c in checks} - {c.module for c in checks if not _finite(c.grad_outputs)}
        candidates = [
            c
            for c in arrived
            if _finite(c.grad_outputs)
            and (not _finite(c.grad_inputs) or (c.module in clean and not _finite(_parameter_sums(c.module))))
        ]
        # A module whose gradient went bad inside a submodule is a candidate too: name the innermost.
        inner = [
            c
            for c in candidates
            if not any(id(o.module) in self._inside[c.module] and o.module is not c.module for o in candidates)
        ]
        if inner:
            return NonFiniteOrigin(self._names[inner[0].module], inner[0].call, self.step, "backward")
        if arrived and not _finite(arrived[0].grad_outputs):
            return NonFiniteOrigin("", 0, self.step, "loss")
        return None

    def remove(self) -> None:
        """Take the hooks off."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._checks = []


def _parameter_sums(module: nn.Module) -> list[Tensor]:
    values: list[Tensor] = []
    _sums((_dense_values(p.grad) for p in module._parameters.values() if p is not None and p.grad is not None), values)
    return values


# -- pictures ---------------------------------------------------------------------------------

PLOTTED = (
    ("modules", "input_rms", "input RMS", True),
    ("modules", "input_zero_fraction", "fraction of exact zeros in the input", False),
    ("parameters", "update_to_weight", "update norm / weight norm", True),
)


def plot(log: str | Path, out: str | Path) -> Path:
    """Draw a ``Monitor`` JSON-lines log as per-layer heatmaps over steps (input RMS, zero fraction,
    update-to-weight ratio) into a PNG; returns its path. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    records = [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{log} holds no record; write one with Monitor(..., jsonl={str(log)!r})")
    steps = [r["step"] for r in records]
    figure, axes = plt.subplots(len(PLOTTED), 1, figsize=(10, 3 + 2.5 * len(PLOTTED)), squeeze=False)
    for axis, (table, statistic, title, logarithmic) in zip(axes[:, 0], PLOTTED, strict=True):
        names = list(dict.fromkeys(n for r in records for n, s in r[table].items() if statistic in s))
        grid = np.full((max(len(names), 1), len(records)), np.nan)
        for column, record in enumerate(records):
            for row, name in enumerate(names):
                value = record[table].get(name, {}).get(statistic)
                if value is not None and math.isfinite(value):
                    grid[row, column] = value
        positive = grid[np.isfinite(grid) & (grid > 0)]
        norm = LogNorm(positive.min(), positive.max()) if logarithmic and positive.size else None
        image = axis.imshow(
            np.ma.masked_invalid(np.where(grid > 0, grid, np.nan) if norm is not None else grid),
            aspect="auto",
            interpolation="nearest",
            norm=norm,
            cmap="viridis",
            extent=(steps[0] - 0.5, steps[-1] + 0.5, len(names) - 0.5, -0.5),
        )
        axis.set_yticks(range(len(names)), names, fontsize=7)
        axis.set_title(title)
        axis.set_xlabel("step")
        figure.colorbar(image, ax=axis)
    figure.tight_layout()
    out = Path(out)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
