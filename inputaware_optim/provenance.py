"""Which tensors of a forward hold the samples (``SampleProvenance``): a torch function mode, active during the
model's forward while a reader asks (DP's batch check, ``Capture.follow_samples``), that follows each tensor back
to the model's arguments and finds the layer calls whose output is broadcast over the samples.

Every tensor the forward computes from an argument of the model carries that argument as its origin. A layer
called on data from no argument (positions ``torch.arange(T)``, a parameter, a buffer) gives its output an origin
of its own, and the mode follows whether that output's rows along the batch dimension stay its own rows until it
meets the samples: added to (or multiplied with, concatenated to, ...) a tensor from the model's arguments. There,
either its rows line up with the samples' (positions expanded or repeated to the batch: exact per sample), or it
is broadcast over them (positions of shape ``(T,)`` or ``(1, T)`` added to ``(B, T, D)`` activations), and its
output gradient is then summed over the samples. The sizes play no part: a batch of 6 on a context of 6 is
told apart from positions by the computation."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import Size, Tensor, nn
from torch.overrides import TorchFunctionMode

from ._torch import tree_flatten

__all__ = ["SampleProvenance"]

PER_SAMPLE, BROADCAST, UNKNOWN = "per sample", "broadcast", "unknown"

_EMPTY: frozenset[_Origin] = frozenset()


class _Origin:
    """Where a tensor's data comes from: an argument of the model (``argument``: its position among the tensors), or
    a layer call on data from none of them (``module``)."""

    __slots__ = ("argument", "module")

    def __init__(self, module: nn.Module | None = None, argument: int | None = None) -> None:
        self.module, self.argument = module, argument


# A tensor's tag: (a weak reference to it, the arguments it comes from, the calls it comes from (when no argument),
# those calls whose rows along the batch dimension it no longer holds as they were).
_Tag = tuple[Any, frozenset[_Origin], frozenset[_Origin], frozenset[_Origin]]

# What each tensor of an operation is to its output, by the function's name (``add``, ``__add__``, ``add_``):
_RIGHT = "right"  # broadcast: dimensions lined up from the right (elementwise operations, expand, repeat)
_ROWS = "rows"  # its rows along the batch dimension become the output's (the input of a linear layer)
_WEIGHT = "weight"  # used for every row (a layer's weight)
_OPERAND = "operand"  # a matrix product's second operand: its rows are the output's only as a batch dimension
_EINSUM = "einsum"  # by the equation's subscripts
_ANY = "any"  # rows regrouped (each bag of an embedding bag a sample): taken as lined up
_CREATES = "creates"  # zeros_like(x), x.new_ones(...): shaped like its input, not its data

_ELEMENTWISE = (  # noqa: SIM905
    "add sub subtract rsub mul multiply div divide true_divide floor_divide remainder fmod pow float_power where "
    "masked_fill maximum minimum fmax fmin atan2 arctan2 hypot copysign xlogy heaviside ldexp nextafter logaddexp "
    "logaddexp2 eq ne lt le gt ge greater less greater_equal less_equal not_equal logical_and logical_or "
    "logical_xor bitwise_and bitwise_or bitwise_xor and or xor addcmul addcdiv lerp clamp clip clamp_min "
    "clamp_max expand expand_as broadcast_to broadcast_tensors repeat tile"
).split()
_LAYERS = (  # noqa: SIM905
    "linear conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d embedding layer_norm group_norm "
    "instance_norm rms_norm batch_norm prelu"
).split()
# The role of the tensor at each position (the last one repeats), by the kind of operation.
_ROLES: dict[str, tuple[str, ...]] = {
    **{name: (_RIGHT,) for name in _ELEMENTWISE},
    **{name: (_ROWS, _WEIGHT) for name in _LAYERS},
    **{name: (_ROWS, _OPERAND) for name in ("matmul", "mm", "bmm", "mv")},
    "rmatmul": (_OPERAND, _ROWS),
    "scaled_dot_product_attention": (_ROWS, _OPERAND, _OPERAND, _RIGHT),
    "einsum": (_EINSUM,),
    "embedding_bag": (_ANY,),
    "bilinear": (_ROWS, _ROWS, _WEIGHT),
}


def _roles(name: str) -> tuple[str, ...]:
    """What each tensor of a call of the function named ``name`` is to its output (``_ROWS`` where no entry says)."""
    if name.endswith("_like") or name.startswith("new_"):
        return (_CREATES,)
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name not in _ROLES and name[:1] in ("r", "i") and name[1:] in _ROLES:
            name = name[1:]  # __radd__, __iadd__ (only __rmatmul__ reverses its operands)
    return _ROLES.get(name.rstrip("_"), (_ROWS,))


_ROLES_BY_NAME: dict[str, tuple[str, ...]] = {}  # (by name: a getter is a new function object at each call)


class SampleProvenance(TorchFunctionMode):
    """One forward's origins of tensors (a torch function mode while the forward runs), and the verdict on each
    layer call: its rows are the samples', it is broadcast over them, or the computation did not tell.

    Args:
        tree: The model's arguments (each tensor in it an origin: an argument of the model).
        batch_dim: The dimension that holds the samples in every layer's input.
    """

    def __init__(self, tree: Any, batch_dim: int = 0) -> None:
        super().__init__()
        self.batch_dim = batch_dim
        self.tags: dict[int, _Tag] = {}
        self.flagged: dict[_Origin, str] = {}  # origin -> how it was broadcast over the samples
        self.met: set[_Origin] = set()  # call origins whose rows lined up with the samples'
        self.calls: list[tuple[nn.Module, frozenset[_Origin], _Origin | None]] = []
        self.interned: dict[frozenset[_Origin], frozenset[_Origin]] = {}
        self.paused = False  # (the library's own hooks run with the mode on the stack)
        self.failed: BaseException | None = None  # a failure here gives no verdict, it never fails the forward
        leaves = [t for t in tree_flatten(tree)[0] if isinstance(t, Tensor)]
        self.arguments = len(leaves)
        for position, tensor in enumerate(leaves):
            if self._tag(tensor) is None:  # (one tensor passed twice: its first position)
                origin = frozenset({_Origin(argument=position)})
                self.tags[id(tensor)] = (weakref.ref(tensor), origin, _EMPTY, _EMPTY)

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        out = func(*args, **kwargs)
        if self.paused or self.failed is not None:
            return out
        try:
            self._follow(func, args, kwargs, out)
        except Exception as error:  # never the user's forward's failure: the verdicts become unknown
            self.failed = error
        return out

    def _tag(self, tensor: Tensor) -> _Tag | None:
        tag = self.tags.get(id(tensor))
        return tag if tag is not None and tag[0]() is tensor else None

    def _follow(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        outs = (out,) if type(out) is Tensor else _outputs(args, out)
        if not outs:
            return
        found: list[tuple[int, Tensor, _Tag]] = []
        position = self._tagged(args, 0, found)
        if kwargs:
            self._tagged(kwargs.values(), position, found)
        if not found:
            return
        name = getattr(func, "__name__", "")
        roles = _ROLES_BY_NAME.get(name)
        if roles is None:
            roles = _ROLES_BY_NAME[name] = _roles(name)
        if roles[0] == _CREATES:
            return
        arguments = found[0][2][1]
        if arguments and (len(found) == 1 or all(tag[1] is arguments for _, _, tag in found)):
            for o in outs:  # the common case: the samples' data, from the same arguments
                self.tags[id(o)] = (weakref.ref(o), arguments, _EMPTY, _EMPTY)
            return
        equation = args[0] if roles[0] == _EINSUM and args and isinstance(args[0], str) else None
        if any(tag[1] for _, _, tag in found):
            self._meet(func, roles, found, outs, equation)
        else:
            self._carry(roles, found, outs, equation)

    def _tagged(self, values: Iterable[Any], position: int, found: list[tuple[int, Tensor, _Tag]]) -> int:
        """Add the tagged tensors among ``values`` (one level of lists and tuples) to ``found``, with their position
        among the operation's tensors (counted from ``position``); the position after them."""
        tags = self.tags
        for value in values:
            if isinstance(value, Tensor):
                tag = tags.get(id(value))
                if tag is not None and tag[0]() is value:
                    found.append((position, value, tag))
                position += 1
            elif type(value) is list or type(value) is tuple:
                position = self._tagged(value, position, found)
        return position

    def _carry(
        self, roles: tuple[str, ...], found: list[tuple[int, Tensor, _Tag]], outs: Sequence[Tensor], equation: Any
    ) -> None:
        """An operation on data from layer calls only: their origins go on, those whose rows moved marked so."""
        calls = self._intern(frozenset().union(*(tag[2] for _, _, tag in found)))
        for o in outs:
            moved: set[_Origin] = set().union(*(tag[3] for _, _, tag in found))
            for position, tensor, tag in found:
                if not self._lined_up(roles, position, tensor, o, equation):
                    moved |= tag[2]
            self.tags[id(o)] = (weakref.ref(o), _EMPTY, calls, frozenset(moved))

    def _meet(
        self,
        func: Callable[..., Any],
        roles: tuple[str, ...],
        found: list[tuple[int, Tensor, _Tag]],
        outs: Sequence[Tensor],
        equation: Any,
    ) -> None:
        """An operation where the samples' data (from the model's arguments) meets other data: what is broadcast
        over the samples there, and which layer calls' rows line up with theirs."""
        arguments = self._intern(frozenset().union(*(tag[1] for _, _, tag in found)))
        out = outs[0]
        lined = [self._lined_up(roles, position, tensor, out, equation) for position, tensor, _ in found]
        for (position, tensor, tag), aligned in zip(found, lined, strict=True):
            # The samples it meets: lined up with the output, from arguments it does not come from.
            partner = next(
                (t for (_, t, other), ok in zip(found, lined, strict=True) if ok and other[1] - tag[1]), None
            )
            if partner is None:
                continue
            if tag[2]:  # data from layer calls: their rows must reach the samples' rows unmoved
                moved = tag[3] | (_EMPTY if aligned else tag[2])
                self._flag(moved, func, tensor, partner, out)
                self.met.update(tag[2] - moved)
            elif not aligned and self._broadcast(_role(roles, position), out):
                self._flag(tag[1], func, tensor, partner, out)  # an argument used for every sample
        for o in outs:
            self.tags[id(o)] = (weakref.ref(o), arguments, _EMPTY, _EMPTY)

    def _intern(self, origins: frozenset[_Origin]) -> frozenset[_Origin]:
        return self.interned.setdefault(origins, origins)

    def _broadcast(self, role: str, out: Tensor) -> bool:
        """Whether a tensor in ``role``, not lined up with an output that holds samples, is used for every one."""
        dim = self.batch_dim
        return out.dim() > dim and out.shape[dim] > 1 and role in (_RIGHT, _WEIGHT, _OPERAND, _EINSUM)

    def _flag(
        self, origins: Iterable[_Origin], func: Callable[..., Any], tensor: Tensor, with_: Tensor, out: Tensor
    ) -> None:
        name = getattr(func, "__name__", repr(func)).strip("_")
        for origin in origins:
            self.flagged.setdefault(
                origin,
                f"{name} takes it as {tuple(tensor.shape)} with the samples' {tuple(with_.shape)} into "
                f"{tuple(out.shape)}",
            )

    def _lined_up(self, roles: tuple[str, ...], position: int, tensor: Tensor, out: Tensor, equation: Any) -> bool:
        """Whether ``tensor``'s rows along the batch dimension are ``out``'s rows there."""
        dim, role = self.batch_dim, _role(roles, position)
        if out.dim() <= dim or tensor.dim() <= dim or role == _WEIGHT:
            return role == _ANY
        if role == _RIGHT:
            shifted = dim - (out.dim() - tensor.dim())
            return shifted >= 0 and tensor.shape[shifted] == out.shape[dim]
        if role == _EINSUM:
            return isinstance(equation, str) and _einsum_lined_up(equation, position, dim)
        if role == _OPERAND and (tensor.dim() != out.dim() or tensor.dim() < dim + 3):
            return False  # a matrix for every row, not a batch of them
        return role == _ANY or tensor.shape[: dim + 1] == out.shape[: dim + 1]

    def called(self, module: nn.Module, outputs: Iterable[Tensor]) -> None:
        """A layer call returned ``outputs``: one from no argument of the model gets an origin of its own."""
        origins: set[_Origin] = set()
        own: _Origin | None = None
        for output in outputs:
            tag = self._tag(output)
            if tag is not None and tag[1]:
                origins |= tag[1]
                continue
            own = own or _Origin(module=module)
            calls = (tag[2] if tag is not None else _EMPTY) | {own}
            self.tags[id(output)] = (weakref.ref(output), _EMPTY, calls, tag[3] if tag is not None else _EMPTY)
        self.calls.append((module, frozenset(origins), own))

    def close(self) -> None:
        """Drop the tags (the forward is over); the verdicts stay."""
        self.tags = {}
        self.interned = {}

    def verdicts(self) -> dict[nn.Module, tuple[str, str | None]]:
        """Each called module's verdict: ``("per sample", None)``, ``("broadcast", how)`` or ``("unknown", None)``,
        broadcast if any of its calls' outputs is, unknown if the computation did not tell for one of them."""
        rank = {PER_SAMPLE: 0, UNKNOWN: 1, BROADCAST: 2}
        out: dict[nn.Module, tuple[str, str | None]] = {}
        for module, arguments, own in self.calls:
            verdict = self._verdict(arguments, own)
            if module not in out or rank[verdict[0]] > rank[out[module][0]]:
                out[module] = verdict
        return out

    def _verdict(self, arguments: frozenset[_Origin], own: _Origin | None) -> tuple[str, str | None]:
        if self.failed is not None or not self.arguments:
            return UNKNOWN, None
        if own is not None and own in self.flagged:
            return BROADCAST, self.flagged[own]
        if arguments and not arguments <= self.flagged.keys():
            return PER_SAMPLE, None
        if arguments:
            return BROADCAST, next(self.flagged[o] for o in arguments)
        return (PER_SAMPLE, None) if own in self.met else (UNKNOWN, None)


def _outputs(args: tuple[Any, ...], out: Any) -> Sequence[Tensor]:
    """The tensors an operation returned (or changed in place, returning nothing: ``__setitem__``)."""
    if isinstance(out, (tuple, list)) and not isinstance(out, Size):
        return [t for t in out if isinstance(t, Tensor)]
    if out is None and args and isinstance(args[0], Tensor):
        return [args[0]]
    return []


def _role(roles: tuple[str, ...], position: int) -> str:
    return roles[position] if position < len(roles) else roles[-1]


def _einsum_lined_up(equation: str, position: int, dim: int) -> bool:
    """Whether operand ``position``'s subscript at ``dim`` is the output's there (``"...``": not told apart)."""
    equation = equation.replace(" ", "")
    if "..." in equation:
        return False
    inputs, _, output = equation.partition("->")
    operands = inputs.split(",")
    if not _:
        letters = "".join(operands)
        output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    if position >= len(operands) or len(operands[position]) <= dim or len(output) <= dim:
        return False
    return operands[position][dim] == output[dim]
