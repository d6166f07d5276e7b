"""Auxiliary-loss-free load balancing of mixture-of-experts routers (DeepSeek-V3), written on the
public API only (a ``Reduction`` and ``register_inputs_hook``): the worked example in CONTRIBUTING.md."""

from __future__ import annotations

import math
import numbers
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .distributed import all_ranks_sum
from .hooks import InputsHookHandle
from .inputs import Call, Inputs
from .reduction import Reduction

__all__ = ["ExpertLoads", "LoadBalancing"]


# What a selection of experts may be: integer indices (a bool mask is not, nor are scores).
_INTEGER_DTYPES = frozenset(
    {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64}
)


def _first_integer_tensor(call: Call) -> Tensor:
    outputs = call.output if isinstance(call.output, (tuple, list)) else (call.output,)
    for output in outputs:
        if isinstance(output, Tensor) and output.dtype in _INTEGER_DTYPES:
            return output
    raise TypeError(
        f"{type(call.module).__name__} returned no integer tensor of selected experts (a bool mask is not one); "
        "pass selected=lambda call: ... (the experts each token was routed to, from call.output)"
    )


class ExpertLoads(Reduction):
    """Tokens each expert received, per router: a bincount of each router call's selected experts, as
    ``{router: counts}`` kept under the router's trained parameter (``key[router]``) while its gradient holds
    the call. Routers sharing that parameter (one gate) keep their own counts under it."""

    reads_output = True

    def __init__(self, experts: dict[nn.Module, int], key: dict[nn.Module, Tensor], selected: Callable[[Call], Tensor]):
        self.experts = experts
        self.key = key
        self.selected = selected

    def wants(self, module: nn.Module) -> bool:
        return module in self.experts

    def forward(self, call: Call) -> dict[nn.Module, Tensor]:
        chosen, experts = self.selected(call), self.experts[call.module]
        if not isinstance(chosen, Tensor) or chosen.dtype not in _INTEGER_DTYPES:
            what = f"a {chosen.dtype} tensor" if isinstance(chosen, Tensor) else type(chosen).__name__
            raise TypeError(
                f"selected= gave {what} for a call of {type(call.module).__name__}; it must give an integer tensor "
                "of the experts each token was routed to (top-k indices, not a mask or scores)"
            )
        counts = torch.bincount(chosen.reshape(-1).long(), minlength=experts)
        if len(counts) > experts:
            raise ValueError(
                f"selected= gave expert {len(counts) - 1} for a call of {type(call.module).__name__}, whose bias "
                f"has {experts} entries (experts 0 to {experts - 1})"
            )
        return {call.module: counts.to(torch.float64)}

    def keys(self, module: nn.Module) -> tuple[Tensor, ...]:
        return (self.key[module],)


class LoadBalancing:
    r"""DeepSeek-V3's auxiliary-loss-free balancing of MoE routers, as a hook of an input-aware optimizer.

    ``LoadBalancing(routers).attach(optimizer)`` moves each router's expert bias after every step,

    .. math::
        b_i \leftarrow b_i + u \cdot \operatorname{sign}(\bar c - c_i), \qquad \bar c = \tfrac1E \textstyle\sum_j c_j

    with :math:`c_i` the tokens expert :math:`i` received in the step, counted from the router
    calls whose gradient the step applies (exact under activation checkpointing, gradient
    accumulation and evaluation forwards; per router, also where routers share a gate; summed over
    data-parallel ranks, a rank whose batch reached no router joining with zeros). Each bias moves
    in a master copy of at least float32 kept here (``state_dict``), written back to the bias
    rounded to its dtype, so a bfloat16 bias moves by steps smaller than its resolution.

    Args:
        routers: The router modules. Each holds its bias (a buffer or a parameter the optimizer
            does not train) under the attribute ``bias``, one entry per expert, and owns, itself
            or through a child (a gate ``nn.Linear``), a parameter the optimizer trains.
        update_rate: ``u``, read at every step (set ``balancing.update_rate`` to schedule it).
        bias: The attribute that holds each router's expert bias.
        selected: ``selected(call)``: the experts the call routed its tokens to, from ``call.output``
            (default: the first integer tensor the router returned, say top-k indices).
    """

    _update_rate: float
    _attached: weakref.ref[Any] | None = None  # the optimizer it balances after (its hook is that optimizer's)

    def __init__(
        self,
        routers: Iterable[nn.Module],
        *,
        update_rate: float = 1e-3,
        bias: str = "expert_bias",
        selected: Callable[[Call], Tensor] | None = None,
    ) -> None:
        self.routers = list(routers)
        if not self.routers or not all(isinstance(r, nn.Module) for r in self.routers):
            raise TypeError("LoadBalancing expects the router modules (a non-empty iterable of nn.Module)")
        for router in self.routers:
            table = getattr(router, bias, None)
            if not isinstance(table, Tensor) or table.dim() != 1 or not table.is_floating_point():
                raise ValueError(
                    f"{type(router).__name__} has no expert bias {bias!r} (a 1-D floating tensor, one entry per "
                    "expert); register it as a buffer, or name it with bias="
                )
        self.update_rate = update_rate
        self.bias = bias
        self.selected = selected or _first_integer_tensor
        self.loads: ExpertLoads | None = None
        self._master: list[Tensor | None] = [None] * len(self.routers)  # each bias as it moves, >= float32

    @property
    def update_rate(self) -> float:
        """``u``, read at every step; a value set later is checked as the constructor's is."""
        return self._update_rate

    @update_rate.setter
    def update_rate(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
            raise ValueError(f"Invalid update_rate: {value!r} (must be a finite number >= 0)")
        self._update_rate = float(value)

    def state_dict(self) -> dict[str, list[Tensor | None]]:
        """``{"master_bias": [...]}``: each router's bias as it moves (float32, float64 for a float64 bias;
        ``None`` before its first move), in the order of ``routers``. Saved with a checkpoint and loaded with
        ``load_state_dict``, a resumed run moves the biases bitwise as the whole run does."""
        return {"master_bias": [None if t is None else t.clone() for t in self._master]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict()``; a master copy that its bias does not round to any more (the model was
        loaded from elsewhere) gives way to the bias at the next step.

        Raises:
            ValueError: If ``state_dict`` does not hold one floating tensor (or ``None``) per router, shaped
                as its bias.
        """
        masters = state_dict.get("master_bias") if isinstance(state_dict, dict) else None
        shapes = [getattr(r, self.bias).shape for r in self.routers]
        if not (
            isinstance(masters, (list, tuple))
            and len(masters) == len(shapes)
            and all(
                t is None or (isinstance(t, Tensor) and t.is_floating_point() and t.shape == shape)
                for t, shape in zip(masters, shapes, strict=True)
            )
        ):
            raise ValueError(
                "LoadBalancing.load_state_dict takes what state_dict() gives: {'master_bias': [...]}, one floating "
                f"tensor (or None) per router shaped as its bias, {[tuple(s) for s in shapes]}"
            )
        self._master = [None if t is None else t.detach().clone() for t in masters]

    def attach(self, optimizer: Any) -> InputsHookHandle:
        """Balance after every step of ``optimizer`` (an input-aware one); ``remove()`` the handle to stop.

        Raises:
            ValueError: If a router trains no parameter of ``optimizer`` (its calls could not be
                told from other steps'), or its bias is trained by the optimizer, or ``optimizer``
                is differentially private (the loads are the batch's, not privatized).
        """
        if any(rule.private for rule in getattr(optimizer, "rules", ())):  # DPSGD, DPAdamW, PerSampleClipping
            raise ValueError(
                f"LoadBalancing on {type(optimizer).__name__}: the expert biases would move by the token counts of "
                "each batch, which no clipping or noise covers, and they are part of the model released. Keep the "
                "biases fixed under DP (or train them as parameters of the DP optimizer)"
            )
        trained = {p for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        key: dict[nn.Module, Tensor] = {}
        for router in self.routers:
            table = getattr(router, self.bias)
            if table in trained:
                raise ValueError(
                    f"the expert bias of {optimizer.capture.name(router)} is trained by the optimizer; the "
                    "balancing moves it instead: keep it out of the optimizer's params (a buffer)"
                )
            owned = [p for p in router.parameters() if p in trained]
            if not owned:
                raise ValueError(
                    f"{optimizer.capture.name(router)} owns no parameter the optimizer trains, so its calls "
                    "cannot be tied to a step; give the optimizer the router's gate"
                )
            key[router] = owned[0]
        self.loads = ExpertLoads({r: getattr(r, self.bias).numel() for r in self.routers}, key, self.selected)
        handle = optimizer.register_inputs_hook(self, when="pre", reads=self.loads)
        self._attached = weakref.ref(optimizer)
        return handle

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Copies (``copy``, ``deepcopy``, ``pickle``) of a balancing not attached (or whose optimizer is gone).

        Raises:
            TypeError: If it is attached: its hook is the optimizer's, which a copy of the optimizer does not
                carry, so the copy would never move a bias (attach a new one to the copy instead).
        """
        if self._attached is not None and self._attached() is not None:
            raise TypeError(
                "a LoadBalancing attached to an optimizer cannot be copied or pickled: it moves the biases from a "
                "hook on that optimizer, and a copy of the optimizer is built without it (as torch's copies drop "
                "their step hooks), so the copied biases would silently never move. Copy (or checkpoint) the model "
                "and the optimizer, then attach a new LoadBalancing of the copy's routers and load this one's state: "
                "balancing = LoadBalancing(copied_routers, ...); balancing.load_state_dict(old.state_dict()); "
                "balancing.attach(copied_optimizer). To checkpoint it, save its state_dict()"
            )
        return super().__reduce_ex__(protocol)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_attached"}  # (a copy is attached to nothing)

    @torch.no_grad()
    def __call__(self, optimizer: Any, inputs: Inputs) -> None:
        """The pre-step hook: count each router's loads (summed over ranks) and move its bias.

        Raises:
            RuntimeError: Before any change, if the parameter a router was attached by no longer trains,
                or has gradient that no captured call on any rank explains (its loads are unknown).
        """
        assert self.loads is not None
        key = self.loads.key
        trained = {p for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        frozen = [_untrained(optimizer, r, key[r]) for r in self.routers if key[r] not in trained]
        if frozen:
            raise RuntimeError(
                f"{'; '.join(frozen)}: requires_grad is False, or it left the optimizer's param groups, so the "
                "router's calls cannot be tied to a step and its loads are unknown; no bias was moved. Train it "
                "again, or remove() the handle attach() returned and attach a LoadBalancing of the other routers"
            )
        totals = inputs.reduced(self.loads)
        counts = [totals.get(key[r], {}).get(r) for r in self.routers]
        # Every rank joins with every router, zeros where its batch reached none.
        device = getattr(self.routers[0], self.bias).device
        shapes = [(self.loads.experts[r],) for r in self.routers]
        summed = all_ranks_sum(counts, shapes, optimizer.data_parallel_group, device)
        # A gradient is explained by a call on some rank (DDP's all-reduce brings it to a rank that had none).
        tokens: dict[Tensor, float] = {}
        for router, load in zip(self.routers, summed, strict=True):
            tokens[key[router]] = tokens.get(key[router], 0.0) + (0.0 if load is None else float(load.sum()))
        unexplained = [
            optimizer.capture.name(r)
            for r in self.routers
            if not tokens[key[r]] and (grad := key[r].grad) is not None and bool(grad.any())
        ]
        if unexplained:
            raise RuntimeError(
                f"{', '.join(unexplained)} got gradient from no captured call (called under no_grad, or its "
                "weight used without calling it), so its loads are unknown; no bias was moved"
            )
        for index, (router, load) in enumerate(zip(self.routers, summed, strict=True)):
            if load is None or not bool(load.any()):
                continue  # no token reached it this step
            table = getattr(router, self.bias)
            master = self._master_of(index, table)
            master.add_(torch.sign(load.mean() - load).to(master), alpha=self.update_rate)
            table.copy_(master)  # rounded to the bias's dtype

    def _master_of(self, index: int, table: Tensor) -> Tensor:
        """Router ``index``'s master copy, on the bias's device and dtype of now; the bias itself where it is no
        longer the master rounded (set since by a checkpoint, by hand, or a cast that changed its value)."""
        dtype = torch.promote_types(table.dtype, torch.float32)
        master = self._master[index]
        if master is not None:
            master = master.to(table.device, dtype)
        if master is None or master.shape != table.shape or not torch.equal(master.to(table.dtype), table):
            master = table.to(dtype, copy=True)
        self._master[index] = master
        return master


def _untrained(optimizer: Any, router: nn.Module, param: Tensor) -> str:
    """``router (router.gate.weight no longer trains)``: the parameter a router was attached by, named."""
    name = optimizer.capture.name(router)
    local = next(
        (f"{name}.{n}" for n, p in router.named_parameters() if p is param), "the parameter it was attached by"
    )
    return f"{name} ({local} no longer trains)"
