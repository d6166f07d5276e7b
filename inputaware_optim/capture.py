"""Capture: records the forward calls of chosen modules until they are read or cleared.

A ``Capture`` puts one forward hook on each module it watches (never a global hook, so
every other module keeps PyTorch's fast call path) and two on the root model, which
make a forward that raises part-way leave nothing behind. It is usable on its own::

    with Capture(model) as capture:
        model(x).sum().backward()
    inputs = capture.inputs()          # Inputs: inputs[model.fc].cat() is x as fc saw it

Semantics:
    * Calls made with grad enabled are recorded, in order; calls under ``torch.no_grad()``
      or ``inference_mode()`` are not.
    * Activation checkpointing: each real call arrives once. Non-reentrant checkpointing
      re-runs forwards during backward; those re-runs are skipped. Reentrant checkpointing
      runs the first forward under ``no_grad``; its re-run in backward is the one recorded.
    * ``storage="reference"`` keeps a reference to each argument (no copy: for an
      ``nn.Linear`` autograd already holds it) and remembers its version counter; reading a
      call whose tensor was modified in place since raises. ``"clone"`` stores a private
      copy, ``"cpu"`` a copy in CPU memory (pinned and asynchronous from CUDA).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten
from torch.utils.hooks import RemovableHandle

from .inputs import Call, Inputs, UncapturedInputsWarning

__all__ = ["Capture", "Storage", "unwrap_model"]

Storage = Literal["reference", "clone", "cpu"]
_STORAGES = ("reference", "clone", "cpu")

# A node of the call log: (module, args, kwargs, check, grad_slot, previous node).
# The log is a linked list grown by rebinding one attribute: under torch.compile a
# Python list would make Dynamo guard on its length and recompile for every new number
# of calls per step (gradient accumulation), while rebinding an attribute does not.
_Node = tuple[nn.Module, tuple[Any, ...], "dict[str, Any] | None", Any, "list[Any] | None", Any]


class _Log:
    """The state the hooks write into. Hooks hold this, never the Capture, so dropping
    the Capture (or the optimizer that owns it) can always run its finalizer."""

    def __init__(self, storage: Storage, grad_outputs: bool) -> None:
        self.head: _Node | None = None
        self.enabled = True
        self.storage = storage
        self.grad_outputs = grad_outputs
        self.forwards: list[list[Any]] = []  # [head at start, finished] per open root forward

    def record(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        # The hot path: every call of every watched module runs this, so the common case
        # (eager, zero-copy, one tensor argument, no output gradients) is kept short.
        if not (self.enabled and _grad_enabled()):
            return None
        if _compiling():
            return self._record_compiled(module, args, kwargs, output)
        if _graph_task_id() != -1 and _recomputing_checkpointed_forward():
            return None
        if self.storage == "reference":
            if not kwargs and len(args) == 1 and type(args[0]) is Tensor:
                check: Any = args[0]._version
            else:
                check = _versions(args, kwargs)
        else:
            args, kwargs, check = _copy_arguments(args, kwargs, self.storage, False)
        slot = _tap_outputs(output) if self.grad_outputs else None
        # An empty kwargs dict is a fresh object per call: not keeping it spares the allocator.
        self.head = (module, args, kwargs or None, check, slot, self.head)
        return None

    def _record_compiled(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        # Traced by Dynamo: no version counters, and output gradients through _GradTap.
        if self.storage != "reference":
            args, kwargs, _ = _copy_arguments(args, kwargs, self.storage, True)
        slot: Any = None
        if self.grad_outputs:
            slot = torch.ops.inputaware_optim.open_grad_slot(_first_tensor(output), id(self), _count_tensors(output))
            output = _tap_compiled_outputs(output, slot, id(self))
        self.head = (module, args, kwargs, None, slot, self.head)
        return output if self.grad_outputs else None

    # The root model's forward is a transaction: a forward that raises part-way must not
    # leave the calls it recorded behind for the next step.
    def open_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not torch.compiler.is_compiling():
            self.forwards.append([self.head, False])

    def close_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not torch.compiler.is_compiling() and self.forwards:
            self.forwards[-1][1] = True

    def end_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        # Registered with always_call=True after close_forward, so it also runs when the
        # forward raised; then close_forward did not, and the calls since the start go.
        if not torch.compiler.is_compiling() and self.forwards:
            start, closed = self.forwards.pop()
            if not closed:
                self.head = start

    def clear(self) -> None:
        self.head = None
        _COMPILED_SLOTS.pop(id(self), None)

    # A model copied (copy.deepcopy) or pickled with its hooks must not carry the captured
    # tensors along, nor keep recording into a log no optimizer reads: the copy is inert.
    def __getstate__(self) -> dict[str, Any]:
        return {"storage": self.storage, "grad_outputs": self.grad_outputs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["storage"], state["grad_outputs"])  # type: ignore[misc]
        self.enabled = False


_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling
_graph_task_id = torch._C._current_graph_task_id


def _versions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    leaves = tree_flatten((args, kwargs))[0]
    return tuple(t._version if isinstance(t, Tensor) else None for t in leaves)


def _copy_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], storage: str, compiling: bool
) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
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


def _tap_outputs(output: Any) -> list[Any] | None:
    if type(output) is Tensor:  # the common case, without the pytree machinery
        slot: list[Any] = [None]
        if output.requires_grad:
            output.register_hook(functools.partial(_store_grad, slot, 0))
        return slot
    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor)]
    slot = [None] * len(leaves)
    for i, t in enumerate(leaves):
        if t.requires_grad:
            t.register_hook(functools.partial(_store_grad, slot, i))
    return slot


def _store_grad(slot: list[Any], index: int, grad: Tensor) -> None:
    # Backward may reach one output several times (it is used twice); the total is what
    # flowed back into the module.
    slot[index] = grad if slot[index] is None else slot[index] + grad


# Output gradients under torch.compile. A tensor hook's body is traced into the backward
# graph, where Python side effects are not allowed, and Dynamo (2.13) drops side effects
# traced after a ``register_hook`` in the same frame. So compiled code instead routes each
# output through ``_GradTap``, whose backward calls a custom op (``store_grad``) that runs
# at run time and files the gradient under a key made by another (``open_grad_slot``).
_COMPILED_SLOTS: dict[int, dict[int, list[Any]]] = {}  # id(_Log) -> key -> gradients per output
_KEYS = iter(range(1, 1 << 62))


@torch.library.custom_op("inputaware_optim::open_grad_slot", mutates_args=())
def _open_grad_slot(like: Tensor, log_id: int, outputs: int) -> Tensor:
    key = next(_KEYS)
    _COMPILED_SLOTS.setdefault(log_id, {})[key] = [None] * outputs
    return torch.tensor(key, dtype=torch.int64)


@_open_grad_slot.register_fake
def _(like: Tensor, log_id: int, outputs: int) -> Tensor:
    return torch.empty((), dtype=torch.int64)


# Declared as mutating ``grad`` (it does not) so that the compiler keeps it; it stores a
# copy, since the compiler may reuse the gradient's buffer once the graph is done with it.
@torch.library.custom_op("inputaware_optim::store_grad", mutates_args=("grad",))
def _store_grad_op(grad: Tensor, key: Tensor, log_id: int, index: int) -> None:
    slot = _COMPILED_SLOTS.get(log_id, {}).get(int(key))
    if slot is not None:
        _store_grad(slot, index, grad.clone())


@_store_grad_op.register_fake
def _(grad: Tensor, key: Tensor, log_id: int, index: int) -> None:
    return None


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


def _first_tensor(output: Any) -> Tensor:
    return next(t for t in tree_flatten(output)[0] if isinstance(t, Tensor))


def _count_tensors(output: Any) -> int:
    return sum(isinstance(t, Tensor) for t in tree_flatten(output)[0])


def _tap_compiled_outputs(output: Any, key: Tensor, log_id: int) -> Any:
    leaves, spec = tree_flatten(output)
    tapped, index = [], 0
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            if leaf.requires_grad:
                leaf = _GradTap.apply(leaf, key, log_id, index)
            index += 1
        tapped.append(leaf)
    return tree_unflatten(tapped, spec)


def _recomputing_checkpointed_forward() -> bool:
    """True while non-reentrant activation checkpointing re-runs a forward in backward."""
    top = _top_saved_tensors_hooks()
    if top is None:
        return False
    return getattr(top[0], "__qualname__", "").startswith("_recomputation_hook")


def _top_saved_tensors_hooks() -> Any:
    get = torch._C._autograd._top_saved_tensors_default_hooks
    try:
        return get(False)
    except TypeError:  # older releases take no argument
        return get()  # type: ignore[call-arg]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module that holds the layers: ``model`` without ``torch.compile`` and data-parallel wrappers."""
    return _wrapper_chain(model)[-1]


def _wrapper_chain(model: nn.Module) -> list[nn.Module]:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    chain = [model]
    while True:
        inner = getattr(chain[-1], "_orig_mod", None)  # torch.compile's OptimizedModule
        if not isinstance(inner, nn.Module):
            if not isinstance(chain[-1], (DistributedDataParallel, DataParallel)):
                return chain
            inner = chain[-1].module
        chain.append(inner)


def _drop_code_compiled_without_hooks(model: nn.Module, root: nn.Module) -> None:
    """Make ``torch.compile`` retrace modules that were compiled and run before our hooks.

    Dynamo does not guard on module hooks (``skip_nnmodule_hook_guards``): code compiled
    before a hook was added never calls it. Dropping that code makes the next call
    recompile with the hooks in place, so captures arrive instead of silently not.
    """
    compiled = [
        m
        for m in [*_wrapper_chain(model), *root.modules()]
        if isinstance(getattr(m, "_orig_mod", None), nn.Module) or getattr(m, "_compiled_call_impl", None) is not None
    ]
    if not compiled:
        return
    try:
        from torch._C._dynamo.eval_frame import reset_code
        from torch._dynamo import external_utils
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError as error:  # pragma: no cover - depends on the torch release
        raise RuntimeError(
            "the model was compiled with torch.compile before this capture was built, and this "
            "release of torch offers no way to retrace it with hooks. Build the optimizer (or "
            "Capture) before the model's first compiled call, or call torch._dynamo.reset() first."
        ) from error
    codes = set()
    for module in compiled:
        inner = getattr(module, "_orig_mod", module)
        codes.add(type(inner).forward.__code__)
        if hasattr(external_utils, "wrap_inline"):
            codes.add(external_utils.wrap_inline(inner).__code__)
    for code in codes:
        if _debug_get_cache_entry_list(code):
            reset_code(code)


def _shutdown(log: _Log, handles: list[RemovableHandle]) -> None:
    # `enabled` is read by the hooks, so compiled code that inlined them sees the change
    # (Dynamo guards on it) and stops recording into a log nobody reads.
    log.enabled = False
    log.clear()
    for handle in handles:
        handle.remove()
    handles.clear()


class Capture:
    """Records the forward calls of modules of ``model`` for rules to read later.

    Args:
        model: The model (``torch.compile`` and data-parallel wrappers are unwrapped).
        modules: The modules to watch. Default: every module that directly owns a parameter.
        storage: ``"reference"`` (default, zero-copy), ``"clone"`` or ``"cpu"``.
        grad_outputs: Also record, on each call, the gradient that reached its outputs in
            backward (``Call.grad_outputs``).

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
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Capture watches an nn.Module, got {type(model).__name__}")
        if storage not in _STORAGES:
            raise ValueError(f"Invalid storage: {storage!r}; choose one of {', '.join(map(repr, _STORAGES))}")
        root = unwrap_model(model)
        self._root = root
        self._names: dict[nn.Module, str] = {}
        for name, module in root.named_modules(remove_duplicate=False):
            self._names.setdefault(module, name or type(root).__name__)
        self._log = _Log(storage, grad_outputs)
        self._handles: list[RemovableHandle] = []
        self._owners: dict[Tensor, tuple[nn.Module, ...]] = {}
        self._modules: list[nn.Module] = []
        self._watched: dict[nn.Module, str] = {}  # watched module -> qualified name
        self._warned: set[int] = set()  # ids of modules already reported as uncaptured
        self._cache: tuple[Any, list[Call]] = (None, [])
        if modules is None:
            modules = [m for m in root.modules() if any(p is not None for p in m._parameters.values())]
        self.add_modules(modules)
        log = self._log
        self._handles += [
            root.register_forward_pre_hook(log.open_forward, with_kwargs=True, prepend=True),
            root.register_forward_hook(log.close_forward, with_kwargs=True),
            root.register_forward_hook(log.end_forward, with_kwargs=True, always_call=True),
        ]
        _drop_code_compiled_without_hooks(model, root)
        self._finalizer = weakref.finalize(self, _shutdown, log, self._handles)

    # -- watching ---------------------------------------------------------------------
    def add_modules(self, modules: Iterable[nn.Module]) -> None:
        """Watch more modules of the model (each at most once).

        Raises:
            ValueError: If a module is not part of the model.
        """
        modules = list(modules)
        for module in modules:
            if module not in self._names:
                raise ValueError(
                    f"{type(module).__name__} is not a submodule of the captured model; "
                    "capture only modules reachable from model.modules()"
                )
        for module in modules:
            if any(m is module for m in self._modules):
                continue
            self._modules.append(module)
            self._watched[module] = self.name(module)
            self._handles.append(module.register_forward_hook(self._log.record, with_kwargs=True))
            for param in module._parameters.values():
                if param is not None:
                    self._owners[param] = (*self._owners.get(param, ()), module)

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """The modules watched."""
        return tuple(self._modules)

    @property
    def storage(self) -> Storage:
        """How captured tensors are kept: ``"reference"``, ``"clone"`` or ``"cpu"``."""
        return self._log.storage

    @property
    def grad_outputs(self) -> bool:
        """Whether output gradients are recorded too."""
        return self._log.grad_outputs

    @grad_outputs.setter
    def grad_outputs(self, value: bool) -> None:
        self._log.grad_outputs = bool(value)

    def owners(self, param: Tensor) -> tuple[nn.Module, ...]:
        """The watched modules that directly own ``param`` (empty if none)."""
        return self._owners.get(param, ())

    def name(self, module: nn.Module) -> str:
        """The qualified name of ``module`` in the model."""
        return self._names.get(module, type(module).__name__)

    # -- reading ----------------------------------------------------------------------
    def calls(self) -> list[Call]:
        """Every call captured so far, in order (tensors detached).

        Raises:
            RuntimeError: If a captured tensor was modified in place after capture.
        """
        head = self._log.head
        if head is not self._cache[0] or head is None:
            self._cache = (head, self._materialize(head))
        return self._cache[1]

    def inputs(self) -> Inputs:
        """A snapshot of what is captured now, as ``Inputs``."""
        return Inputs(self.calls(), self._owners, self._watched)

    def _live_inputs(self) -> Inputs:
        """``Inputs`` that read the log at each access (used for the duration of one step)."""
        return Inputs(self.calls, self._owners, self._watched, on_missing=self._warn_missing)

    def uncaptured(self) -> dict[str, nn.Module]:
        """The watched modules that own a parameter with a gradient but have no captured call.

        Typical causes: the module's weight is used without calling the module (as
        ``nn.MultiheadAttention`` does with ``out_proj``), the forward ran before
        ``zero_grad()`` or under ``no_grad``, or compiled code runs without the hooks.
        """
        called = {id(c.module) for c in self.calls()}
        return {
            self.name(m): m
            for m in self._modules
            if id(m) not in called and any(p is not None and p.grad is not None for p in m._parameters.values())
        }

    def _warn_missing(self, param: Tensor) -> None:
        modules = [m for m in self._owners.get(param, ()) if id(m) not in self._warned]
        if not modules:
            return
        self._warned.update(id(m) for m in modules)
        names = ", ".join(self.name(m) for m in modules)
        warnings.warn(
            f"a rule asked for the inputs of {names}, whose parameter has a gradient, but no forward "
            "call of it was captured; the rule gets None and treats it as it treats uncaptured "
            "parameters. Typical causes: the weight is used without calling the module (as "
            "nn.MultiheadAttention does with out_proj), the forward ran before zero_grad() or under "
            "no_grad(), or compiled code (torch.compile of a function that calls the model before "
            "the optimizer existed) runs without the hooks. Capture.uncaptured() lists them all.",
            UncapturedInputsWarning,
            stacklevel=4,
        )

    def clear(self) -> None:
        """Forget every captured call (releasing every captured tensor)."""
        self._log.clear()
        self._cache = (None, [])

    def remove(self) -> None:
        """Take the hooks off the model. What was captured stays readable until cleared."""
        self._log.enabled = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"Capture({len(self._modules)} modules, storage={self.storage!r})"

    def _materialize(self, head: _Node | None) -> list[Call]:
        nodes: list[_Node] = []
        while head is not None:
            nodes.append(head)
            head = head[5]
        nodes.reverse()
        calls = []
        for index, (module, args, kwargs, check, slot, _) in enumerate(nodes):
            kwargs = kwargs or {}
            if self._log.storage == "reference":
                if check is not None:
                    _check_versions(self.name(module), index, args, kwargs, check)
                args, kwargs = _detached(args), _detached(kwargs)
            elif check is not None:  # copies still on their way from an accelerator
                for event in check:
                    event.synchronize()
            if isinstance(slot, Tensor):  # recorded by compiled code: the gradients are filed by key
                slot = _COMPILED_SLOTS.get(id(self._log), {}).get(int(slot), [])
            calls.append(Call(module, args, kwargs, slot))
        return calls


def _detached(tree: Any) -> Any:
    """``tree`` with every tensor detached; flat tuples and dicts without the pytree machinery."""
    if type(tree) is tuple and not any(isinstance(x, _CONTAINERS) for x in tree):
        return tuple(x.detach() if isinstance(x, Tensor) else x for x in tree)
    if type(tree) is dict and not any(isinstance(x, _CONTAINERS) for x in tree.values()):
        return {k: x.detach() if isinstance(x, Tensor) else x for k, x in tree.items()}
    return tree_map_only(Tensor, Tensor.detach, tree)


_CONTAINERS = (list, tuple, dict)


def _check_versions(name: str, index: int, args: Sequence[Any], kwargs: dict[str, Any], check: Any) -> None:
    if isinstance(check, int):
        now: Any = args[0]._version
    else:
        now = tuple(t._version if isinstance(t, Tensor) else None for t in tree_flatten((args, kwargs))[0])
    if now != check:
        raise RuntimeError(
            f"an input of {name} (call {index} of this step) was modified in place after the "
            "forward captured it, so it no longer holds what produced the gradient. Avoid the "
            "in-place operation, or construct the optimizer (or Capture) with storage='clone'"
        )
