"""Capture: records the forward calls of chosen modules and follows their gradient (docs/capture.md): a
parameter gets exactly the calls whose gradient is in its ``.grad``. Only what readers declared is kept (raw
calls: ``keep_calls``; ``Reduction`` statistics); with neither, no hook is attached."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils.hooks import RemovableHandle

from . import _torch
from ._torch import (
    compiler_disabled,
    drop_compiled_code,
    prepare_compiler_disabled,
    remove_hooks_of,
    tree_flatten,
    tree_map_only,
    tree_unflatten,
)
from .inputs import Call, Inputs, UncapturedInputsWarning
from .ledger import Entry, GradientLedger
from .provenance import SampleProvenance
from .reduction import Reduction

__all__ = ["Capture", "Storage", "module_names", "parameter_names", "unwrap_model"]

Storage = Literal["reference", "clone", "cpu"]


@dataclasses.dataclass(slots=True, eq=False)
class _Record:
    """One forward call on its way: what readers keep of it until its backward pass is complete."""

    module: nn.Module
    index: int
    forward: int  # which root forward
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] | None = None
    check: Any = None  # version counters (reference storage) or copy events (cpu)
    slot: list[Any] | None = None  # output gradients, when a reader wants them
    kept: list[Any] | None = None  # per reduction: forward() result, then backward()'s
    task: int | None = None  # the backward pass that reached it
    waiting: int = 0  # outputs whose gradient has not arrived yet
    outputs: int = 0  # outputs that can carry a gradient
    deferred: bool = False  # some reader's forward waits for checkpointing's recomputation
    # Reached by a pass that accumulates into none of its parameters' gradients (an input
    # gradient): it waits for the next pass, its readers' forward results kept in forward_kept.
    rearm: bool = False
    forward_kept: list[Any] | None = None
    output: Any = None  # compiled code's call: what it returned, until its readers' forward (Reduction.reads_output)

    def view(self) -> Call:
        return Call(self.module, _detached(self.args), _detached(self.kwargs or {}), self.slot, self.forward)

    def snapshot(self) -> _Record:
        """What a reader of raw calls sees, as a copy a later pass through this call leaves alone."""
        slot = None if self.slot is None else list(self.slot)
        return _Record(self.module, self.index, self.forward, self.args, self.kwargs, self.check, slot)


@dataclasses.dataclass(slots=True, eq=False)
class _Task:
    """One backward pass: the calls it reached, each gradient before it, and its loss scale (or ``None``)."""

    scale: float | None
    records: list[_Record] = dataclasses.field(default_factory=list)
    before: dict[Entry, Any] = dataclasses.field(default_factory=dict)
    kinds: dict[Entry, str] = dataclasses.field(default_factory=dict)  # what the pass does with each key (reach)
    returned: dict[Entry, Tensor] = dataclasses.field(default_factory=dict)  # what torch.autograd.grad returns
    handles: list[RemovableHandle] = dataclasses.field(default_factory=list)  # the tensor hooks that see those
    # The pass accumulated into some .grad: it does into the others it reaches (not asked again).
    accumulates: bool = False


class _Log:
    """The state the hooks write into (they hold this, never the Capture, so its finalizer can run)."""

    def __init__(self, storage: Storage, grad_outputs: bool, inert: bool = False) -> None:
        self.enabled = not inert
        self.inert = inert  # a copy's, made with the model: records nothing (see __reduce__)
        self.storage = storage
        self.grad_outputs = grad_outputs  # raw output gradients (Call.grad_outputs)
        self.keep_calls = False
        self.reductions: list[Reduction] = []
        self.readers: dict[nn.Module, tuple[Reduction, ...]] = {}
        # module -> what its readers need: (output gradients, inputs kept, a forward, a backward)
        self.needs: dict[nn.Module, tuple[bool, bool, bool, bool]] = {}
        self.own_keys: dict[nn.Module, tuple[Entry, ...]] = {}  # module -> its own parameters' keys
        self.producers: dict[nn.Module, tuple[Reduction, ...]] = {}  # readers with Reduction.produced
        self.keys_of: dict[nn.Module, tuple[Entry, ...]] = {}  # own keys and those its readers name
        self.ledger = GradientLedger()  # what each parameter's gradient holds
        self.tasks: dict[int, _Task] = {}
        self.counter = itertools.count()
        self.forwards = 0
        self.input_shapes: dict[int, list[torch.Size]] | None = None  # by forward, once a reader asked
        # Capture.follow_samples: the batch dimension followed (None: not followed), each forward's provenance,
        # and those of the forwards running now (None for one not followed: compiled, no_grad).
        self.follow: int | None = None
        self.provenances: dict[int, SampleProvenance] = {}
        self.following: list[SampleProvenance | None] = []
        self.error: str | Exception | None = None
        self.grad_scaler: Any = None
        self.keep_outputs = False  # some reduction reads call.output (compiled code keeps it until backward)
        # Calls recorded by compiled code, (module, args, kwargs, output, key, previous): a linked list grown by
        # rebinding one attribute, as Dynamo would guard on a list's length (a recompile per call count).
        self.head: Any = None
        self.compiled: dict[int, _Record] = {}
        # Checkpointed calls whose readers wait for the re-run's inputs, by (region, module).
        self.awaiting: dict[tuple[int, nn.Module], collections.deque[_Record]] = {}
        self.watchers: dict[nn.Module, tuple[Callable[..., Any], ...]] = {}  # Capture.watch
        self.openers: tuple[Callable[..., Any], ...] = ()

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy of the model (deepcopy, pickle, torch.save) carries our hooks but no capture: they
        # record nothing and come off at its next forward.
        return (_Log, (self.storage, False, True))

    def set_readers(self, module: nn.Module, readers: tuple[Reduction, ...]) -> None:
        """Who reads ``module`` now, and what they need of each call. The parameters readers name
        (``Reduction.keys``) may be a child's (a router's gate): those gradients then hold its calls."""
        own = self.own_keys.get(module, ())
        below = {id(p) for p in module.parameters()}  # a child's parameters, not another module's
        named = [p for r in readers for p in r.keys(module) if id(p) in below and not any(k.param is p for k in own)]
        keys = (*own, *(self.ledger.entry(p) for p in dict.fromkeys(named)))
        if keys or not any(k.param is None for k in self.keys_of.get(module, ())):
            self.keys_of[module] = keys or (Entry(None),)
        self.producers[module] = tuple(r for r in readers if type(r).produced is not Reduction.produced)
        if not self.producers[module]:
            del self.producers[module]
        if not readers:
            self.readers.pop(module, None)
            self.needs.pop(module, None)
            return
        self.readers[module] = readers
        self.needs[module] = (
            any(r.grad_outputs for r in readers),
            any(r.keeps_inputs for r in readers),
            any(type(r).forward is not Reduction.forward for r in readers),
            any(type(r).backward is not Reduction.backward for r in readers),
        )

    def open_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.inert:
            for submodule in module.modules():
                remove_hooks_of(submodule, self)
            return
        for opener in self.openers:
            opener(module, args, kwargs)
        if not torch.compiler.is_compiling():
            self.count_forward(args, kwargs)
            if self.follow is not None:
                self.open_provenance(args, kwargs)
        elif self.input_shapes is not None:  # a reader of each forward's batch (DP): counted eagerly, a graph break
            _count_forward_eagerly(self, args, kwargs)

    def open_provenance(self, args: Any, kwargs: Any) -> None:
        """Follow the samples through this forward (a torch function mode until it returns), if its calls count."""
        if (
            self.follow is None
            or not _grad_enabled()
            or _functorch_level() is not None
            or (_graph_task_id() != -1 and _recomputing_checkpointed_forward())
        ):
            self.following.append(None)  # its calls are not recorded
            return
        provenance = SampleProvenance((args, kwargs), self.follow)
        self.provenances[self.forwards] = provenance
        if len(self.provenances) > _INPUT_SHAPES_KEPT:
            del self.provenances[next(iter(self.provenances))]
        self.following.append(provenance)
        provenance.__enter__()

    def close_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """The model's forward returned (or raised): the samples are no longer followed through it."""
        if self.following:
            provenance = self.following.pop()
            if provenance is not None:
                _torch.remove_function_mode(provenance)  # (on top, unless the forward left a mode of its own)
                provenance.close()

    def stop_following(self) -> None:
        """End the following of the forwards running now (their hooks are being removed)."""
        while self.following:
            provenance = self.following.pop()
            if provenance is not None:
                _torch.remove_function_mode(provenance)
                provenance.close()

    def count_forward(self, args: Any, kwargs: Any) -> None:
        """A new forward of the model (its calls' ``Call.forward``), and its input shapes if kept."""
        self.forwards += 1
        if self.input_shapes is not None and _grad_enabled():
            self.input_shapes[self.forwards] = _batch_shapes((args, kwargs))
            if len(self.input_shapes) > _INPUT_SHAPES_KEPT:
                del self.input_shapes[next(iter(self.input_shapes))]

    def record(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if not _grad_enabled():  # (the hot path: every call of every watched module)
            return None
        provenance = self.following[-1] if self.following else None
        if provenance is None:
            return self._record(module, args, kwargs, output, None)
        # The library's own operations are no part of the model's computation: off the mode's stack (or, under
        # a mode of the user's, passed through).
        popped = _pause_function_mode(provenance)
        provenance.paused = not popped
        try:
            return self._record(module, args, kwargs, output, provenance)
        finally:
            provenance.paused = False
            if popped:
                _resume_function_mode(provenance)

    def _record(
        self,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
        provenance: SampleProvenance | None,
    ) -> Any:
        for watcher in self.watchers.get(module, ()):
            watcher(module, args, kwargs, output)
        if not self.enabled or module not in self.keys_of:
            return None  # (a module only a watcher sees)
        if _compiling():
            # Who reads is decided at run time: read here, it would be a guard (a recompile per pause).
            return self._record_compiled(module, args, kwargs, output)
        if not self.keep_calls and module not in self.readers:
            return None  # nothing reads this module now (a reader paused, say between statistics steps)
        if _functorch_level() is not None or (_graph_task_id() != -1 and _recomputing_checkpointed_forward()):
            return None  # inside vmap/grad, or checkpointing's re-run in backward: not a call of the step
        outputs = _differentiable_outputs(output)
        if outputs is None:
            return None  # no gradient can come back through this call
        if provenance is not None:
            provenance.called(module, outputs)
        record = _Record(module, next(self.counter), self.forwards)
        if self.keep_calls:
            self._keep_arguments(record, args, kwargs)
        if self.readers.get(module):
            self._read_forward(record, args, kwargs, output, len(outputs))
        elif self.grad_outputs:
            record.slot = [None] * len(outputs)
        for position, t in enumerate(outputs):  # hooks that see the gradients reach its outputs
            if t.requires_grad:
                record.outputs += 1
                if (node := t.grad_fn) is None:  # a leaf returned as output
                    t.register_hook(functools.partial(self.arrive, record, position))
                else:
                    node.register_prehook(functools.partial(self._node_gradient, record, position, t.output_nr))
        record.waiting = record.outputs
        if module in self.producers and (first := outputs[0].grad_fn) is not None:
            first.register_hook(functools.partial(self._produced, module))
        return None

    def _keep_arguments(self, record: _Record, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.storage != "reference":
            args, kwargs, record.check = _copy_arguments(args, kwargs, self.storage, False)
        elif not kwargs and len(args) == 1 and type(args[0]) is Tensor:
            record.check = None if args[0].is_inference() else args[0]._version
        else:
            record.check = _versions(args, kwargs)
        record.args, record.kwargs = args, kwargs or None

    def _read_forward(self, record: _Record, args: Any, kwargs: Any, output: Any, count: int) -> None:
        """The readers' forward on a call, now or (inputs kept under checkpointing) when recomputed."""
        readers = self.readers[record.module]
        wants_grads, keeps_inputs, forward, _ = self.needs[record.module]
        if self.grad_outputs or wants_grads:
            record.slot = [None] * count
        if not forward:  # no reader computes anything from the inputs
            record.kept = [None] * len(readers)
            return
        frame = _torch.checkpoint_frame() if keeps_inputs else None
        if frame is not None:  # activation checkpointing: the inputs come back when recomputed
            record.deferred = True
            self.awaiting.setdefault((id(frame), record.module), collections.deque()).append(record)
        detached = output.detach() if type(output) is Tensor else _detached(output)
        call = Call(record.module, _detached(args), _detached(kwargs), None, record.forward, detached)
        record.kept = self.reduce(
            lambda: [_DEFERRED if frame is not None and r.keeps_inputs else r.forward(call) for r in readers]
        )

    def _produced(self, module: nn.Module, grad_inputs: Any, grad_outputs: Any) -> None:
        """A call's first output node computed the gradients it sends back (``Reduction.produced``)."""
        for reader in self.producers.get(module, ()):
            self.reduce(functools.partial(reader.produced, module, grad_inputs))

    def arrived(self, param: Tensor, grad: Tensor) -> None:
        """A tensor hook on a watched parameter: ``grad`` is about to be added to its ``.grad``."""
        for reader in {r: None for m, readers in self.producers.items() for r in readers if r.receives(m, param)}:
            self.reduce(functools.partial(reader.arrived, param, grad))

    def recomputed(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook: checkpointing's re-run in backward hands its inputs to readers that keep inputs."""
        if not self.awaiting or _graph_task_id() == -1 or not _recomputing_checkpointed_forward():
            return
        where = (id(_torch.checkpoint_frame()), module)
        queue = self.awaiting.get(where)
        if not queue:
            return
        record = queue.popleft()  # a region re-runs its calls in their forward order
        if not queue:
            del self.awaiting[where]
        readers = self.readers.get(module, ())
        if record.kept is None or len(readers) != len(record.kept):
            return  # a reader came or went since: the pass's end reports what is missing
        call = Call(module, _detached(args), _detached(kwargs), None, record.forward)
        kept = record.kept
        record.kept = self.reduce(
            lambda: [r.forward(call) if k is _DEFERRED else k for r, k in zip(readers, kept, strict=True)]
        )
        record.deferred = False
        if record.waiting == 0 and record.task is not None:  # its output gradients arrived first
            self._reduce_backward(record, self.tasks[record.task].scale if record.task in self.tasks else None)

    def _node_gradient(self, record: _Record, position: int, output_nr: int, grads: Sequence[Any]) -> None:
        self.arrive(record, position, grads[output_nr])

    def arrive(self, record: _Record, position: int, grad: Tensor | None) -> None:
        task_id = _graph_task_id()
        task = self.tasks.get(task_id)
        if task is None:  # the pass's first gradient to reach a recorded call
            scaler = self.grad_scaler
            scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0
            task = self.tasks[task_id] = _Task(None if scale == 1.0 else scale)
            # end_backward queued at the pass's end: it runs after callbacks queued later (DDP, FSDP)
            end = functools.partial(self.end_backward, task_id)
            _torch.queue_end_of_backward(functools.partial(_torch.queue_end_of_backward, end))
            self.ledger.refresh()  # before the pass accumulates into any gradient (a later look: a rescaling)
        if record.task is None:
            self._join(record, task, task_id)
        elif record.task != task_id:
            self.error = (
                f"backward ran twice through one forward call (of {type(record.module).__name__}), for example "
                "with retain_graph=True; what it contributed cannot be told apart. Run one backward per forward"
            )
            return
        if record.slot is not None and grad is not None:
            previous = record.slot[position]  # reached twice (an output used twice): the total flowed back
            record.slot[position] = grad if previous is None else previous + grad
        record.waiting -= 1
        if record.waiting == 0 and not record.deferred:  # (a deferred one is reduced once recomputed)
            self._reduce_backward(record, task.scale)

    def _join(self, record: _Record, task: _Task, task_id: int) -> None:
        record.task = task_id
        task.records.append(record)
        keys = self.keys_of.get(record.module, ())
        rearm = bool(keys)
        for key in keys:
            kind = task.kinds.get(key)
            if kind is None:
                task.before[key] = key.state()
                kind = task.kinds[key] = _torch.ACCUMULATES if task.accumulates else key.reach()
                if kind == _torch.ACCUMULATES and key.param is not None and key.param.requires_grad:
                    task.accumulates = True
                elif kind == _torch.RETURNS:  # see the very tensor torch.autograd.grad will return
                    assert key.param is not None
                    task.handles.append(key.param.register_hook(functools.partial(task.returned.__setitem__, key)))
            rearm = rearm and kind != _torch.ACCUMULATES
        record.rearm = rearm and not record.deferred and record.module is not _PENDING

    def _reduce_backward(self, record: _Record, scale: float | None) -> None:
        if scale is not None and record.slot is not None:  # readers see the gradients of the unscaled loss
            # (float16 ones in float32: unscaled in float16, what the scale kept out of the subnormals is lost)
            record.slot = [
                None if g is None else (g.float() if g.dtype == torch.float16 else g) / scale for g in record.slot
            ]
        readers = self.readers.get(record.module)
        if readers and record.kept is not None:
            if self.needs[record.module][3]:  # some reader's backward does something
                call = Call(record.module, (), {}, record.slot, record.forward)
                kept = record.kept
                if record.rearm:
                    record.forward_kept = kept
                record.kept = self.reduce(lambda: [r.backward(call, k) for r, k in zip(readers, kept, strict=True)])
            record.waiting = -1  # reduced

    def end_backward(self, task_id: int) -> None:
        task = self.tasks.pop(task_id, None)
        if task is None:
            return
        for handle in task.handles:
            handle.remove()
        changed = {key for key, before in task.before.items() if key.param is None or key.state() != before}
        # Calls whose gradient went into no .grad wait for the next pass through them (a gradient penalty's
        # backward after its autograd.grad(create_graph=True)); if none comes, they go with their graph.
        waiting = {
            id(r) for r in task.records if r.rearm and not any(k in changed for k in self.keys_of.get(r.module, ()))
        }
        self._settle_records(task)
        returned = set(task.returned)
        counted = [
            r
            for r in task.records
            if id(r) not in waiting or any(key in returned for key in self.keys_of.get(r.module, ()))
        ]
        finished = self._finish_reductions(counted)
        snapshots = {id(r): r.snapshot() for r in task.records if self.keep_calls and id(r) in waiting and returned}
        self._release_records(task, waiting)
        self._commit(task, changed, snapshots, finished)

    def _commit(self, task: _Task, changed: set[Entry], snapshots: dict[int, _Record], finished: Any) -> None:
        """The ledger's commit of the pass: the calls of each entry it reached, a returned gradient's own."""
        reached = {key: [r for r in task.records if key in self.keys_of.get(r.module, ())] for key in task.kinds}
        returned = {
            key: (grad, [snapshots.get(id(r), r) for r in reached.get(key, ())] if self.keep_calls else [])
            for key, grad in task.returned.items()
        }
        task.returned.clear()
        self.ledger.commit(changed, reached if self.keep_calls else None, returned, finished)

    def _settle_records(self, task: _Task) -> None:
        """A checkpointed call never recomputed is an error; one with outputs that got no gradient is reduced."""
        for record in task.records:
            if record.deferred:
                self.error = self.error or (
                    f"the inputs of a checkpointed call of {type(record.module).__name__} were not recomputed in "
                    "backward, so its per-call statistics are missing; run the module outside the checkpointed "
                    "region"
                )
                record.kept, record.deferred = None, False
            elif record.waiting > 0:
                self._reduce_backward(record, task.scale)

    def _finish_reductions(self, records: list[_Record]) -> list[tuple[Reduction, dict[Tensor, Any]]]:
        """Each reduction's ``finish`` over the pass's calls it read: ``{parameter: statistics}``."""
        finished: list[tuple[Reduction, dict[Tensor, Any]]] = []
        for reduction in self.reductions:
            entries = []
            for record in records:
                readers = self.readers.get(record.module, ())
                if reduction in readers and record.kept is not None:
                    call = Call(record.module, (), {}, record.slot, record.forward)
                    entries.append((call, record.kept[readers.index(reduction)]))
            totals = self.reduce(functools.partial(reduction.finish, entries)) if entries else None
            if totals is not None:
                finished.append((reduction, totals))
        return finished

    def _release_records(self, task: _Task, waiting: set[int]) -> None:
        """Free what the reductions kept of the pass's calls; re-arm those waiting for the next pass."""
        for record in task.records:
            if id(record) in waiting:  # ready for the next pass, with its readers' forward results
                record.task, record.waiting, record.rearm = None, record.outputs, False
                if record.forward_kept is not None:
                    record.kept, record.forward_kept = record.forward_kept, None
                if record.slot is not None:
                    record.slot = [None] * len(record.slot)
                continue
            record.kept = record.forward_kept = None  # (inputs, output gradients)
            if not self.keep_calls:
                record.slot = None
                record.args, record.kwargs = (), None
            self.compiled.pop(record.index, None)

    @compiler_disabled  # (never traced: hooks that ran eagerly inside a compiled call, after a graph break)
    def reduce(self, compute: Any) -> Any:
        """Run reductions' code from a hook, with no autograd graph and no autocast (reductions keep the dtypes
        they choose: statistics in float32 under a bfloat16 autocast); an error is kept, raised at the next read
        (not mid-backward)."""
        previous = _grad_enabled()
        if previous:  # (off already in a backward pass)
            _set_grad_enabled(False)  # torch.no_grad() without the context manager's cost (hot path)
        try:
            if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
                with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
                    return compute()
            return compute()
        except Exception as error:
            if self.error is None:
                self.error = error  # raised at the read, as its own type, from this one
            return None
        finally:
            if previous:
                _set_grad_enabled(True)

    def _record_compiled(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        # Traced by Dynamo: a custom op opens a record at run time, the arguments are kept in ``head``,
        # and each output passes through _GradTap, whose backward files the gradient.
        if self.storage != "reference":
            args, kwargs, _ = _copy_arguments(args, kwargs, self.storage, True)
        leaves, spec = tree_flatten(output)
        tensors = [t for t in leaves if isinstance(t, Tensor)]
        if not tensors:
            return None
        key = torch.ops.inputaware_optim.open_call(tensors[0], id(self), len(tensors))
        self.head = (module, args, kwargs, _detached(output) if self.keep_outputs else None, key, self.head)
        tapped = iter([_GradTap.apply(t, key, id(self), i) if t.requires_grad else t for i, t in enumerate(tensors)])
        return tree_unflatten([next(tapped) if isinstance(leaf, Tensor) else leaf for leaf in leaves], spec)

    def open_compiled(self, outputs: int) -> int:
        if not (self.keep_calls or self.readers):
            return -1  # nothing reads any module now: no record
        key = next(self.counter)
        self.compiled[key] = _Record(_PENDING, key, self.forwards, waiting=outputs, outputs=outputs)
        return key

    def arrive_compiled(self, key: int, position: int, grad: Tensor) -> None:
        self._bind_compiled()
        record = self.compiled.get(key)
        if record is None and key >= 0:  # (a key of -1: opened while nothing read)
            self.error = (
                "a call recorded by compiled code reached backward after the capture had released it "
                "(its step() or clear() came between the forward and the backward)"
            )
        if record is None or record.module is _PENDING:
            return
        readers = self.readers.get(record.module)
        if record.task is None and record.kept is None and readers:
            # First gradient of the call: the readers' forward, from the kept arguments.
            args, kwargs = _detached(record.args), _detached(record.kwargs or {})
            call = Call(record.module, args, kwargs, None, record.forward, record.output)
            if self.needs[record.module][0]:
                record.slot = record.slot or [None] * record.outputs
            record.kept, record.output = self.reduce(lambda: [r.forward(call) for r in readers]), None
        if record.slot is None and self.grad_outputs:
            record.slot = [None] * record.outputs  # (every position a tapped output can have)
        self.arrive(record, position, grad)

    def _bind_compiled(self) -> None:
        """Give the records compiled code opened their module and arguments (the linked list ``head``)."""
        node, self.head = self.head, None
        while node is not None:
            module, args, kwargs, output, opened, node = node
            bound = self.compiled.get(int(opened))
            if bound is not None and (self.keep_calls or module in self.readers):  # (else left pending: unread)
                bound.module, bound.args, bound.kwargs, bound.output = module, args, kwargs or None, output
                if self.storage == "reference" and self.keep_calls:  # later reads check these versions
                    bound.check = _versions(args, kwargs or {})

    def clear(self) -> None:
        self.ledger.release({*self.ledger.entries.values(), *(k for keys in self.keys_of.values() for k in keys)})
        self.head = self.error = None
        self.compiled.clear()
        self.awaiting.clear()


# Compiled code keeps no count of forwards (read in traced code, it would be a guard: a recompile per
# forward); where a reader needs each forward's batch (DP's batch check), the count runs eagerly at the
# forward's start. Under fullgraph=True that graph break is an error, which carries this reason.
_count_forward_eagerly = compiler_disabled(
    _Log.count_forward,
    reason=(
        "DPSGD / DPAdamW (PerSampleClipping) read each forward's batch eagerly, at the start of the model's "
        "forward: the samples each layer's call holds are checked against the model's inputs. That is one graph "
        "break, which torch.compile(model, fullgraph=True) refuses. Compile the model without fullgraph=True "
        "(torch.compile(model)): the rest of its forward still compiles, and DP clips it exactly"
    ),
)
_DEFERRED = object()  # a reader's forward result still to come (checkpointing's re-run)
_PENDING = nn.Module()  # the module of a compiled call until its arguments are bound
_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling
# Reached through _torch.py, where each is tested (hot path: bound once here).
_set_grad_enabled = _torch.set_grad_enabled
_graph_task_id = _torch.graph_task_id
_functorch_level = _torch.functorch_level
_recomputing_checkpointed_forward = _torch.recomputing_checkpointed_forward
_pause_function_mode = _torch.pause_function_mode
_resume_function_mode = _torch.resume_function_mode


_INPUT_SHAPES_KEPT = 256  # forwards whose model input shapes are kept (a step reads the last few)


def _versions(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Tensors' version counters (inference tensors, which cannot change outside inference mode, have none)."""
    leaves = tree_flatten((args, kwargs))[0]
    return tuple(t._version if isinstance(t, Tensor) and not t.is_inference() else None for t in leaves)


def _copy_arguments(args: Any, kwargs: Any, storage: str, compiling: bool) -> tuple[Any, Any, Any]:
    events: list[Any] = []

    def copy(t: Tensor) -> Tensor:
        t = t.detach()
        if storage == "clone" or t.device.type == "cpu":
            return t.clone()
        if compiling or not t.is_cuda:
            return t.to("cpu", copy=True)
        # Pinned memory lets the copy run asynchronously; readers wait on the event.
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        out.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        events.append(event)
        return out

    args, kwargs = tree_map_only(Tensor, copy, (args, kwargs))
    return args, kwargs, tuple(events) or None


# Gradients under torch.compile: a tensor hook's body is traced into the backward graph (no Python side
# effects), and Dynamo (2.13) drops side effects traced after a ``register_hook``. So each output passes
# through ``_GradTap``, whose backward calls a custom op (``store_grad``) that files the gradient at run
# time under a key made by another (``open_call``).
_LOGS: weakref.WeakValueDictionary[int, _Log] = weakref.WeakValueDictionary()


@torch.library.custom_op("inputaware_optim::open_call", mutates_args=())
def _open_call(like: Tensor, log_id: int, outputs: int) -> Tensor:
    log = _LOGS.get(log_id)
    key = log.open_compiled(outputs) if log is not None else -1
    return torch.tensor(key, dtype=torch.int64)


_open_call.register_fake(lambda like, log_id, outputs: torch.empty((), dtype=torch.int64))


# Declared as mutating ``grad`` (it does not) so the compiler keeps it (and torch makes its fake); it
# stores a copy, as the compiler may reuse the gradient's buffer.
@torch.library.custom_op("inputaware_optim::store_grad", mutates_args=("grad",))
def _store_grad_op(grad: Tensor, key: Tensor, log_id: int, index: int) -> None:
    log = _LOGS.get(log_id)
    if log is not None and log.enabled:
        log.arrive_compiled(int(key), index, grad.clone())


class _GradTap(torch.autograd.Function):
    """Identity (a copy: a view would forbid in-place ops after the module) whose backward files the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, key: Tensor, log_id: int, index: int) -> Tensor:
        ctx.save_for_backward(key)
        ctx.log_id, ctx.index = log_id, index
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (key,) = ctx.saved_tensors
        torch.ops.inputaware_optim.store_grad(grad, key, ctx.log_id, ctx.index)
        return grad, None, None, None


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module that holds the layers: ``model`` without ``torch.compile`` and data-parallel wrappers."""
    return _wrapper_chain(model)[-1]


def _batch_shapes(tree: Any) -> list[torch.Size]:
    """The shapes of the tensors in ``tree``; a ``PackedSequence`` as the batch-first padded tensor it packs
    (its data's rows are the tokens of every sequence, not samples)."""
    leaves = tree_flatten(tree, is_leaf=lambda x: isinstance(x, PackedSequence))[0]
    return [
        torch.Size([int(t.batch_sizes[0]), len(t.batch_sizes), *t.data.shape[1:]])
        if isinstance(t, PackedSequence)
        else t.shape
        for t in leaves
        if isinstance(t, (Tensor, PackedSequence))
    ]


def module_names(model: nn.Module) -> dict[nn.Module, str]:
    """Every module of ``model`` (unwrapped) by its first qualified name, as the model holds them now (the root: "")."""
    return {module: name for name, module in unwrap_model(model).named_modules()}


def parameter_names(model: nn.Module) -> dict[Tensor, tuple[str, nn.Module]]:
    """Every parameter of ``model`` (unwrapped) by its first qualified name now, with the module that registers it
    under that name (a pruned weight is its module's ``weight_orig``; a tied one is named where first found)."""
    named: dict[Tensor, tuple[str, nn.Module]] = {}
    for module, prefix in module_names(model).items():
        for name, param in module._parameters.items():
            if param is not None and param not in named:
                named[param] = (f"{prefix}.{name}" if prefix else name, module)
    return named


def _wrapper_chain(model: nn.Module) -> list[nn.Module]:
    chain = [model]
    while True:
        inner = getattr(chain[-1], "_orig_mod", None)  # torch.compile's OptimizedModule
        if not isinstance(inner, nn.Module):
            if not isinstance(chain[-1], (nn.parallel.DistributedDataParallel, nn.DataParallel)):
                return chain
            inner = chain[-1].module
        chain.append(inner)


def _drop_code_compiled_without_hooks(model: nn.Module, root: nn.Module) -> None:
    """Make ``torch.compile`` retrace modules compiled before our hooks: Dynamo does not guard on
    module hooks (``skip_nnmodule_hook_guards``), so code compiled before them never calls them."""
    compiled = [
        m
        for m in [*_wrapper_chain(model), *root.modules()]
        if isinstance(getattr(m, "_orig_mod", None), nn.Module) or getattr(m, "_compiled_call_impl", None) is not None
    ]
    if compiled and not drop_compiled_code(compiled):
        raise RuntimeError(
            "the model was compiled with torch.compile before this capture was built, and this "
            "release of torch offers no way to retrace it with hooks. Build the optimizer (or "
            "Capture) before the model's first compiled call, or call torch._dynamo.reset() first."
        )


def _shutdown(log: _Log, handles: dict[Any, RemovableHandle]) -> None:
    # Compiled code that inlined the hooks guards on `enabled`: it stops recording into a log nobody reads.
    log.enabled = False
    log.clear()
    log.ledger.returned.clear()
    log.stop_following()
    for handle in handles.values():
        handle.remove()
    handles.clear()


@dataclasses.dataclass(eq=False)
class _Watching:
    """A ``Capture.watch``: its modules (or which to select) and callbacks; ``remove()`` ends it."""

    capture: weakref.ref[Capture]
    modules: list[nn.Module]
    on_call: Callable[..., Any]
    on_forward: Callable[..., Any] | None
    select: Callable[[nn.Module], bool] | None = None
    reason: str | None = None  # why it runs eagerly in compiled code (what fullgraph=True's error says)

    def remove(self) -> None:
        capture = self.capture()
        if capture is not None and self in capture._watches:
            capture._set_watches([w for w in capture._watches if w is not self])

    def follow(self, *_: Any) -> None:
        """Before each forward: select the modules again, as the model holds them now (one added or replaced)."""
        capture = self.capture()
        if capture is not None and self.select is not None:
            now = [m for m in capture._root.modules() if self.select(m)]
            if now != self.modules:
                self.modules = capture._part_of_model(now)
                capture._set_watches(capture._watches)


class Capture:
    """Records the forward calls of modules of ``model`` and follows their gradient.

    Args:
        model: The model (``torch.compile`` and data-parallel wrappers are unwrapped).
        modules: The modules to watch. Default: every module that directly owns a parameter.
        storage: ``"reference"`` (default, zero-copy), ``"clone"`` or ``"cpu"``.
        grad_outputs: Also record each call's output gradients (``Call.grad_outputs``).
        keep_calls: Keep the raw calls for ``inputs()`` / ``calls()`` (an optimizer: only if its rule reads them).

    Raises:
        TypeError: If ``model`` is not an ``nn.Module``.
        ValueError: If ``storage`` is unknown or a module is not part of ``model``.
    """

    def __init__(
        self,
        model: nn.Module,
        modules: Iterable[nn.Module] | None = None,
        *,
        storage: Storage = "reference",
        grad_outputs: bool = False,
        keep_calls: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Capture watches an nn.Module, got {type(model).__name__}")
        if storage not in get_args(Storage):
            raise ValueError(f"Invalid storage: {storage!r}; choose one of {', '.join(map(repr, get_args(Storage)))}")
        for wrapper in _wrapper_chain(model):  # (hooks would fire on replicas nobody owns)
            if isinstance(wrapper, nn.DataParallel) and len(wrapper.device_ids or ()) > 1:
                raise ValueError(
                    f"nn.DataParallel over {len(wrapper.device_ids)} devices runs every forward on new replicas "
                    "of the model, whose calls cannot be told apart from the model's own; use "
                    "DistributedDataParallel (one process per device), as torch recommends"
                )
        self._model, self._root = model, unwrap_model(model)
        self._names: dict[nn.Module, str] = {}
        self._name_modules()
        self._log = _Log(storage, grad_outputs)
        _LOGS[id(self._log)] = self._log
        self._handles: dict[tuple[str, int], RemovableHandle] = {}  # by (callback, id of its module or parameter)
        self._owners: dict[Tensor, tuple[nn.Module, ...]] = {}
        self._watched: dict[nn.Module, str] = {}  # watched module -> qualified name
        self._cache: tuple[Any, tuple[list[Call], dict[Tensor, list[Call]]]] = (None, ([], {}))
        self._watches: list[_Watching] = []
        if modules is None:
            modules = [m for m in self._root.modules() if any(p is not None for p in m._parameters.values())]
        self.add_modules(modules)
        self._finalizer = weakref.finalize(self, _shutdown, self._log, self._handles)
        self.keep_calls = keep_calls

    def add_modules(self, modules: Iterable[nn.Module]) -> None:
        """Watch more modules of the model (each at most once); one not in the model raises ``ValueError``."""
        modules = self._part_of_model(modules)
        log, order = self._log, {m: i for i, m in enumerate(self._names)}  # owners in the model's order
        for module in modules:
            if module in self._watched:
                continue
            self._watched[module] = self.name(module)
            params = [p for p in module._parameters.values() if p is not None]
            for param in params:
                self._owners[param] = tuple(sorted((*self._owners.get(param, ()), module), key=order.__getitem__))
            log.own_keys[module] = tuple(log.ledger.entry(p) for p in dict.fromkeys(params))
            log.set_readers(module, tuple(r for r in log.reductions if r.wants(module)))
        self._sync_hooks()

    def remove_modules(self, modules: Iterable[nn.Module]) -> None:
        """Stop watching ``modules``: their hooks come off and what their calls left in the gradients goes."""
        log, gone = self._log, [m for m in dict.fromkeys(modules) if m in self._watched]
        for module in gone:
            del self._watched[module]
            log.set_readers(module, ())
            log.own_keys.pop(module, None)
            log.keys_of.pop(module, None)
            if (handle := self._handles.pop(("recomputed", id(module)), None)) is not None:
                handle.remove()
        if not gone:
            return
        for param, owners in list(self._owners.items()):
            if kept := tuple(m for m in owners if m in self._watched):
                self._owners[param] = kept
            else:
                del self._owners[param]
        log.ledger.forget({key for keys in log.keys_of.values() for key in keys})
        self._sync_hooks()

    def _part_of_model(self, modules: Iterable[nn.Module]) -> list[nn.Module]:
        modules = list(dict.fromkeys(modules))
        for module in (m for m in modules if m not in self._names):
            self._name_modules()  # modules added to the model since
            if module not in self._names:
                raise ValueError(
                    f"{type(module).__name__} is not a submodule of the captured model; "
                    "capture only modules reachable from model.modules()"
                )
        return modules

    def _name_modules(self) -> None:
        self._names.update({m: n or type(m).__name__ for m, n in module_names(self._root).items()})

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """The modules watched."""
        return tuple(self._watched)

    @property
    def storage(self) -> Storage:
        """How captured tensors are kept: ``"reference"``, ``"clone"`` or ``"cpu"``."""
        return self._log.storage

    @property
    def grad_outputs(self) -> bool:
        """Whether output gradients are recorded with the raw calls."""
        return self._log.grad_outputs

    @grad_outputs.setter
    def grad_outputs(self, value: bool) -> None:
        self._log.grad_outputs = bool(value)

    @property
    def root(self) -> nn.Module:
        """The module that holds the layers (the model without compile and data-parallel wrappers)."""
        return self._root

    def model_input_shapes(self, forward: int | None) -> list[torch.Size] | None:
        """The shapes of the model's tensor arguments in forward number ``forward`` (a ``Call.forward``).

        The first call starts keeping them (the latest 256 eager forwards with grad enabled); ``None`` for
        a forward not kept (before that, compiled, or under ``no_grad``)."""
        if self._log.input_shapes is None:
            self._log.input_shapes = {}
        return None if forward is None else self._log.input_shapes.get(forward)

    def follow_samples(self, batch_dim: int | None = 0) -> None:
        """Follow the samples through each forward from now on (``samples_of_calls`` reads what was found);
        ``None`` stops.

        A torch function mode, active while the model's forward runs (eagerly, with grad enabled), follows every
        tensor back to the model's tensor arguments, which hold the samples along ``batch_dim`` (0, or 1 for
        sequence-first tensors); a watched layer called on data from none of them (positions ``torch.arange(T)``,
        a parameter) is followed until its output meets the samples' data, where its rows line up with theirs, or
        it is broadcast over them. It costs a few microseconds per operation of the forward.

        Raises:
            ValueError: If ``batch_dim`` is not 0, 1 or ``None``.
        """
        if batch_dim not in (0, 1, None) or isinstance(batch_dim, bool):
            raise ValueError(f"Invalid batch_dim: {batch_dim!r} (must be 0, 1 for sequence-first inputs, or None)")
        self._log.follow = batch_dim
        self._sync_hooks()

    def samples_of_calls(self, forward: int | None) -> dict[nn.Module, tuple[str, str | None]] | None:
        """Whether each watched module's calls in forward number ``forward`` (a ``Call.forward``) held the samples:
        ``("per sample", None)``, ``("broadcast", how)`` (its output broadcast over the samples), or
        ``("unknown", None)`` (the computation did not tell: its output never met the samples' data). ``None`` for
        a forward not followed (before ``follow_samples``, compiled, under ``no_grad``, or one of the latest 256
        no longer); a module absent was not recorded in it."""
        provenance = None if forward is None else self._log.provenances.get(forward)
        return None if provenance is None else provenance.verdicts()

    @property
    def keep_calls(self) -> bool:
        """Whether raw calls are kept (for ``inputs()``, ``calls()`` and rules that read calls)."""
        return self._log.keep_calls

    @keep_calls.setter
    def keep_calls(self, value: bool) -> None:
        if bool(value) != self._log.keep_calls:
            self._log.keep_calls = bool(value)
            self.clear()
            self._log.ledger.returned.clear()  # (kept with or without raw calls as it was)
            self._sync_hooks()

    @property
    def grad_scaler(self) -> Any:
        """The ``torch.amp.GradScaler`` whose loss scale output gradients carry (readers get them divided by it)."""
        return self._log.grad_scaler

    @grad_scaler.setter
    def grad_scaler(self, scaler: Any) -> None:
        if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self._log.grad_scaler = scaler

    @property
    def reductions(self) -> tuple[Reduction, ...]:
        """The reductions computed in the hooks."""
        return tuple(self._log.reductions)

    def add_reduction(self, reduction: Reduction) -> None:
        """Compute ``reduction`` in the hooks from now on, for the watched modules it wants."""
        if not isinstance(reduction, Reduction):
            raise TypeError(f"add_reduction expects a Reduction, got {type(reduction).__name__}")
        log = self._log
        if reduction in log.reductions:
            return
        log.reductions.append(reduction)
        log.keep_outputs = any(r.reads_output for r in log.reductions)
        for module in self._watched:
            if reduction.wants(module):
                log.set_readers(module, (*log.readers.get(module, ()), reduction))
        self._sync_hooks()

    def remove_reduction(self, reduction: Reduction, *, keep_hooks: bool = False) -> None:
        """Stop computing ``reduction`` and drop what it holds. ``keep_hooks`` keeps the hooks on even if
        nothing reads (for a reader that pauses: a compiled model is then not retraced when it resumes)."""
        log = self._log
        if reduction not in log.reductions:
            return
        log.reductions.remove(reduction)
        log.keep_outputs = any(r.reads_output for r in log.reductions)
        for module, readers in list(log.readers.items()):
            log.set_readers(module, tuple(r for r in readers if r is not reduction))
        for key in log.ledger.entries.values():
            key.totals.pop(reduction, None)
        if not keep_hooks:
            self._sync_hooks()

    def holds(self) -> bool:
        """Whether it holds what a backward captured for a step not yet taken (or cleared)."""
        return any(key.holds() for keys in self._log.keys_of.values() for key in keys)

    @property
    def active(self) -> bool:
        """Whether anything reads this capture (raw calls or a reduction): only then are hooks attached."""
        return self._log.keep_calls or bool(self._log.reductions) or bool(self._watches)

    def _sync_hooks(self) -> None:
        """Attach the hooks while something reads, take them off when nothing does."""
        handles, log, root = self._handles, self._log, self._root
        if not log.enabled or not self.active:  # (removed: they are off for good)
            log.stop_following()  # (a forward running now: its hook that would end the following is gone)
            for handle in handles.values():
                handle.remove()
            handles.clear()
            return
        if not handles:
            handles["open", id(root)] = root.register_forward_pre_hook(log.open_forward, with_kwargs=True, prepend=True)
            _drop_code_compiled_without_hooks(self._model, root)
            prepare_compiler_disabled()  # (if torch.compile is in use: made now, never while traced)
        if log.follow is not None and ("close", id(root)) not in handles:  # (also when the forward raises)
            handles["close", id(root)] = root.register_forward_hook(
                log.close_forward, with_kwargs=True, always_call=True
            )
        self._sync_forward_hooks()
        for module in self._watched:  # the inputs of checkpointing's re-run (Reduction.keeps_inputs)
            if ("recomputed", id(module)) not in handles and any(r.keeps_inputs for r in log.readers.get(module, ())):
                handles["recomputed", id(module)] = module.register_forward_pre_hook(log.recomputed, with_kwargs=True)
        for module, readers in log.producers.items():  # parameters whose arriving gradients a reader audits
            for param in dict.fromkeys(p for r in readers for p in r.keys(module) if r.receives(module, p)):
                if ("arrived", id(param)) not in handles and param.requires_grad:
                    handles["arrived", id(param)] = param.register_hook(functools.partial(log.arrived, param))
        for key in log.ledger.entries.values():  # asked for now: compiled code's backward cannot look them up
            key.find_accumulator()

    def _sync_forward_hooks(self) -> None:
        """One forward hook on each watched module and each module a watch sees, none on others."""
        hooked = {("record", id(m)): m for m in (*self._watched, *self._log.watchers)}
        for key in [k for k in self._handles if k[0] == "record" and k not in hooked]:  # a watch ended
            self._handles.pop(key).remove()
        for key, module in hooked.items():
            if key not in self._handles:
                self._handles[key] = module.register_forward_hook(self._log.record, with_kwargs=True)

    def watch(
        self,
        modules: Iterable[nn.Module] | Callable[[nn.Module], bool],
        on_call: Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], None],
        on_forward: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None] | None = None,
        *,
        reason: str | None = None,
    ) -> _Watching:
        """Call ``on_call(module, args, kwargs, output)`` after every call (grad enabled) of each of ``modules``
        and ``on_forward(root, args, kwargs)`` before every forward, through the capture's own hooks.
        ``modules`` may be a predicate instead: the modules of the model it selects, as the model holds them
        at each forward (a module added or replaced since is watched from then on).

        They run eagerly in compiled code too (a graph break at each watched call), so
        ``torch.compile(fullgraph=True)`` refuses the model while the watch lasts: its error carries
        ``reason`` (name the tool, and what to do). The callbacks must not hold the tool that registered
        them, so its finalizer can run. ``remove()`` on the returned handle ends the watch. A module not in
        the model raises ``ValueError``."""
        # Traced, a callback's bookkeeping would be guarded on (a recompile per tensor it keys by) or dropped.
        on_call = torch.compiler.disable(on_call, reason=reason)
        on_forward = on_forward and torch.compiler.disable(on_forward, reason=reason)
        select = None
        if not isinstance(modules, Iterable):
            select, modules = modules, [m for m in self._root.modules() if modules(m)]
        watching = _Watching(weakref.ref(self), self._part_of_model(modules), on_call, on_forward, select, reason)
        self._set_watches([*self._watches, watching])
        return watching

    def _set_watches(self, watches: list[_Watching]) -> None:
        watchers: dict[nn.Module, tuple[Callable[..., Any], ...]] = {}
        for watching in watches:
            for module in watching.modules:
                watchers[module] = (*watchers.get(module, ()), watching.on_call)
        self._watches, self._log.watchers = watches, watchers
        # The selections first (they hook this forward's calls), eagerly in compiled code too.
        openers = [torch.compiler.disable(w.follow, reason=w.reason) for w in watches if w.select is not None]
        self._log.openers = (*openers, *(w.on_forward for w in watches if w.on_forward is not None))
        self._sync_hooks()

    def owners(self, param: Tensor) -> tuple[nn.Module, ...]:
        """The watched modules that directly own ``param`` (empty if none)."""
        return self._owners.get(param, ())

    def name(self, module: nn.Module) -> str:
        """The qualified name of ``module`` in the model (the root: its class name)."""
        if module not in self._names:
            self._name_modules()  # added to the model since
        return self._names.get(module, type(module).__name__)

    def refresh(self) -> None:
        """Drop what cleared gradients no longer hold (reads do this themselves).

        Raises:
            RuntimeError: If the gradient could not be followed (for example backward ran
                twice through one call); the captures are then dropped.
        """
        error = self._log.error
        if error is not None:
            self.clear()
            if not isinstance(error, Exception):
                raise RuntimeError(f"{error}. The captures of this step were dropped")
            message = (
                f"{error} (raised by a reader's code in the capture's hooks; the captures of this step were dropped)"
            )
            try:
                again = type(error)(message)
            except Exception:  # an exception type that takes other arguments
                again = RuntimeError(f"{type(error).__name__}: {message}")
            raise again from error
        self._log.ledger.refresh()

    def _gradients_rescaled(self) -> None:
        """The optimizer rescaled the gradients in place (unscaling): they still hold the same calls."""
        self._log.ledger.rescaled_in_place()

    def calls(self) -> list[Call]:
        """The calls whose gradient the parameters hold now, in capture order (tensors detached).

        Raises:
            RuntimeError: If a captured tensor was modified in place after capture.
        """
        return self._committed()[0]

    def _committed(self) -> tuple[list[Call], dict[Tensor, list[Call]]]:
        """The committed calls in order and by parameter (one tuple object per generation)."""
        self.refresh()
        log = self._log
        generation = log.ledger.generation
        if self._cache[0] != generation or log.storage == "reference":  # (copies are checked once)
            records = {id(r): r for keys in log.keys_of.values() for key in keys for r in key.calls}
            ordered = sorted(records.values(), key=lambda r: r.index)
            for index, record in enumerate(ordered):
                self._check_record(record, index)
            if self._cache[0] != generation:
                calls = {id(r): r.view() for r in ordered}
                entries = log.ledger.entries
                by_param = {param: [calls[id(r)] for r in key.calls] for param, key in entries.items() if key.calls}
                self._cache = (generation, (list(calls.values()), by_param))
        return self._cache[1]

    def reduced(self, reduction: Reduction) -> dict[Tensor, Any]:
        """What ``reduction`` holds now, per parameter (statistics of the calls in its gradient)."""
        self.refresh()
        return self._log.ledger.totals(reduction)

    def inputs(self) -> Inputs:
        """A snapshot of what is captured now, as ``Inputs``."""
        committed = self._committed()
        reduced = {r: self.reduced(r) for r in self._log.reductions}
        return Inputs(lambda: committed, self._owners, self._watched, reduced=reduced)

    def step_inputs(self, given: Any = None) -> Inputs:
        """The ``Inputs`` a step hands its rules: ``given`` (an ``Inputs``, or a mapping of modules or parameters to
        captured calls), or by default what is captured, read at each access for the duration of the step."""
        if given is None:
            return self._live_inputs()
        if isinstance(given, Inputs):
            if given._expired:
                raise RuntimeError(given._expired)
            return given
        if isinstance(given, Mapping):
            named = {param: name for param, (name, _) in parameter_names(self._root).items()}
            return Inputs.from_mapping(given, self._owners, self._watched, parameter_names=named, module_name=self.name)
        raise TypeError(
            "step(inputs=...) expects an inputaware_optim.Inputs (for example Capture.inputs()) or a "
            f"mapping from modules or parameters to Captured calls, got {type(given).__name__}"
        )

    def _live_inputs(self) -> Inputs:
        """``Inputs`` that read the capture at each access (used for the duration of one step)."""
        on_missing = functools.partial(self._warn_missing, set())  # (a module once per step, at every step it happens)
        kept = functools.partial(getattr, self._log, "keep_calls")
        return Inputs(
            self._committed, self._owners, self._watched, on_missing=on_missing, reduced=self, calls_kept=kept
        )

    def uncaptured(self) -> dict[str, nn.Module]:
        """The watched modules that own a parameter with a gradient but no call in it (say, a weight used
        without calling its module, as ``nn.MultiheadAttention`` does with ``out_proj``)."""
        self.refresh()
        return {
            self.name(m): m
            for m in self._watched
            if not any(k.holds() for k in self._log.keys_of[m])
            and any(p is not None and p.grad is not None for p in m._parameters.values())
        }

    def _warn_missing(self, warned: set[int], param: Tensor) -> None:
        modules = [m for m in self._owners.get(param, ()) if id(m) not in warned]
        grad = param.grad
        if not modules or (grad is not None and not (grad.coalesce().values() if grad.is_sparse else grad).any()):
            return  # (an all-zero gradient: any rule's update of it is the stock one; say, a checkpointer's state init)
        warned.update(id(m) for m in modules)
        names = ", ".join(f"{self.name(m)} ({type(m).__name__})" for m in modules)
        if self._log.ledger.released(param):
            message = (
                f"a rule asked for the inputs of {names}, but its gradient was already stepped with: the previous "
                "step() released its calls and no backward ran since. Step once per backward; the rule gets None "
                "and treats the parameter as uncaptured"
            )
        else:
            message = (
                f"a rule asked for the inputs of {names}, whose gradient holds no captured call; the rule gets None "
                "and treats it as uncaptured. Typical causes: the weight is used without calling the module (as "
                "nn.MultiheadAttention does with out_proj), the forward ran under no_grad(), compiled code built "
                "before the optimizer runs without the hooks, or the gradient was set by hand to a tensor other "
                "than the one torch.autograd.grad returned. Capture.uncaptured() lists them all."
            )
        warnings.warn(message, UncapturedInputsWarning, stacklevel=4)

    def clear(self) -> None:
        """Forget what the gradients hold (not what a gradient ``autograd.grad`` returned holds: in no ``.grad``)."""
        self._log.clear()
        self._cache = (None, ([], {}))

    def remove(self) -> None:
        """Take the hooks off the model. What was captured stays readable until cleared."""
        self._log.enabled = False
        self._sync_hooks()

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"Capture({len(self._watched)} modules, storage={self.storage!r})"

    def _check_record(self, record: _Record, index: int) -> None:
        check, args = record.check, record.args
        if check is None:
            return
        if self._log.storage != "reference":  # copies still on their way from an accelerator
            for event in check:
                event.synchronize()
            return
        if check != (args[0]._version if isinstance(check, int) else _versions(args, record.kwargs or {})):
            raise RuntimeError(
                f"an input of {self.name(record.module)} (call {index} of this step) was modified in place after "
                "the forward captured it, so it no longer holds what produced the gradient. Avoid the "
                "in-place operation, or construct the optimizer (or Capture) with storage='clone'"
            )


def _differentiable_outputs(output: Any) -> list[Tensor] | None:
    """A call's output tensors, or ``None`` when no gradient can come back through any of them."""
    if type(output) is Tensor:  # the common case, without the pytree machinery
        return [output] if output.requires_grad else None
    outputs = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor)]
    return outputs if any(t.requires_grad for t in outputs) else None


def _detached(tree: Any) -> Any:
    """``tree`` with every tensor detached; flat tuples and dicts without the pytree machinery."""
    if type(tree) is tuple and len(tree) == 1 and type(tree[0]) is Tensor:  # (the common call: one tensor)
        return (tree[0].detach(),)
    if type(tree) is dict and not tree:
        return {}
    if type(tree) is tuple and not any(isinstance(x, _CONTAINERS) for x in tree):
        return tuple(x.detach() if isinstance(x, Tensor) else x for x in tree)
    if type(tree) is dict and not any(isinstance(x, _CONTAINERS) for x in tree.values()):
        return {k: x.detach() if isinstance(x, Tensor) else x for k, x in tree.items()}
    return tree_map_only(Tensor, Tensor.detach, tree)


_CONTAINERS = (list, tuple, dict)
