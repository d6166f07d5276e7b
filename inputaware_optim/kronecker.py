"""The machinery FOOF, K-FAC and Eva share: Kronecker factors from captured calls, kept and inverted.

Each factor is a ratio of sums computed in the hooks (a ``Reduction``), so micro-batches and ranks
combine exactly and no input is held between forward and step.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from .capture import module_names
from .coverage import layer_treatment
from .distributed import (
    ParallelLayout,
    all_reduce_sum_,
    computed_once,
    full_matrix_rows,
    local_call,
    local_matrix_rows,
    local_tensor,
    row_range,
    row_sharding_problem,
    set_local_matrix_rows,
    shard_dim,
    sharded,
    tensor_parallel_style,
)
from .inputs import Call, Captured, Inputs
from .inverses import (
    INVERSES,
    Check,
    _NotPositiveDefinite,
    condition,
    damped_inverse,
    eigenbasis,
    eigenvalue_condition,
    inverse_from_eigenbasis,
    refuse_any,
)
from .layers import ConvKind, Layer, LayerKind, LinearKind, bias_of, layer_kind, weight_of
from .reduction import Reduction
from .rule import Rule

Sums = dict[str, tuple[Tensor, float]]  # a layer's factor sums: {factor: (numerator, the rows they sum)}

__all__ = [
    "INVERSES",
    "FactorSums",
    "KroneckerPreconditioner",
    "damped_inverse",
    "eigenbasis",
    "inverse_from_eigenbasis",
]
_STATE_SUFFIXES = ("_second_moment", "_inverse", "_eigenvalues", "_eigenvectors", "_inverse_damping", "_mean")


class FactorSums(Reduction):
    """A Kronecker rule's factor sums per layer (``{factor: (numerator, denominator)}``), computed
    in the hooks and kept under the layer's weight. Per call, by default in the forward hook: the
    input factor's, ``side`` of its input rows and their number; subclasses read more of the call."""

    def __init__(self, layers: list[Layer]) -> None:
        self.layers = {module: layer for layer in layers for module in layer.modules()}

    def wants(self, module: nn.Module) -> bool:
        # A layer of width 0 (Linear(6, 0)) has nothing to precondition: its step is the stock one. (A lazy
        # module's weight is sized at its first call.)
        return module in self.layers and (is_lazy(weight := weight_of(module)) or weight.numel() > 0)

    def keys(self, module: nn.Module) -> tuple[Tensor, ...]:
        return (weight_of(module),)

    @staticmethod
    def side(rows: Tensor) -> Tensor:
        """A side's sum over ``rows`` (per block if grouped): ``x̃ᵀx̃``."""
        return rows.mT @ rows

    def forward(self, call: Call) -> Any:
        layer = self.layers[call.module]
        rows = layer.kind.input_rows(call.module, Captured([local_call(call)]), layer.homogeneous)
        return {"input": (self.side(rows), float(rows.shape[-2]))}  # (a count known here: no device read)


class KroneckerPreconditioner(Rule):
    """Base of the Kronecker-factored rules (the inverses, schedule and data parallelism: docs/rules/foof.md).

    Subclasses set ``label`` (how the coverage report names them), ``factors`` and ``statistics`` (the
    ``FactorSums`` computing each call's sums), implement ``_precondition`` (the new gradient matrix from the
    old one and the damped inverses) and may override ``_damping``; one that inverts nothing (Eva) overrides
    ``_precondition_layers``. State per preconditioned weight (``rule.state[weight]``):
    ``<factor>_second_moment``, ``<factor>_inverse`` and ``statistics_steps``; with ``inverse="eigh"`` also
    ``<factor>_eigenvalues``, ``<factor>_eigenvectors`` and ``<factor>_inverse_damping`` (the damping the
    inverse was formed with). Hyperparameters in every param group: ``damping``, ``stat_decay``,
    ``update_every``, ``statistics_every`` (and ``schedule_step``, the steps taken). Where an inverse is formed
    (a refresh, or a new damping under ``"eigh"``) the matrix the step inverts is held to the contract of
    ``inverses`` (``_check_inverted``): at or over ``condition_limit``, the step is refused before any change.
    """

    layers: ClassVar[str | None] = "input_rows"
    label: ClassVar[str] = "Kronecker"
    factors: tuple[str, ...] = ()
    statistics: type[FactorSums] = FactorSums
    inverts: ClassVar[bool] = True
    # Whether ``_precondition`` maps each row of G̃ by itself (G̃ A⁻¹): then a rank holding some
    # of the rows (FSDP2) preconditions them without the others.
    acts_on_rows: ClassVar[bool] = False
    # What is formed of each damped factor, and the state key it is kept under (``<factor>_<key>``): its inverse,
    # or (WhitenedMuon, ``power = -0.5``, which forms it from the eigendecomposition) its inverse square root.
    power: ClassVar[float] = -1.0
    kept_as: ClassVar[str] = "inverse"
    _statistics: FactorSums | None = None

    def __init__(
        self,
        damping: float = 0.1,
        stat_decay: float = 0.95,
        update_every: int = 10,
        *,
        statistics_every: int = 1,
        max_dim: int | None = None,
        distributed_inversion: bool = False,
        inverse: str = "cholesky",
        inverse_dtype: torch.dtype = torch.float64,
    ) -> None:
        if max_dim is not None and not _positive_integer(max_dim):
            raise ValueError(f"Invalid max_dim: {max_dim!r} (must be None or an integer >= 1)")
        if not isinstance(distributed_inversion, bool):
            raise ValueError(f"Invalid distributed_inversion: {distributed_inversion!r} (must be True or False)")
        if inverse not in INVERSES:
            raise ValueError(f"Invalid inverse: {inverse!r} (must be one of {', '.join(map(repr, INVERSES))})")
        if inverse_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"Invalid inverse_dtype: {inverse_dtype!r} (must be torch.float64 or torch.float32)")
        self._max_dim, self._distributed_inversion = max_dim, distributed_inversion
        self._inverse, self._inverse_dtype = inverse, inverse_dtype
        own = dict(damping=damping, stat_decay=stat_decay, update_every=update_every, statistics_every=statistics_every)
        self.defaults = {**own, **self.__dict__.get("defaults", {})}  # (a subclass's own, set before, kept)
        for key in ("damping", "stat_decay", "update_every", "statistics_every"):
            self.check_group({**self.defaults, key: self.defaults[key]})
        self._armed = True

    @property
    def reads(self) -> list[Reduction]:  # type: ignore[override]
        """The factor sums, read exactly on the steps that collect statistics: between, the hooks keep nothing."""
        return [self._statistics] if self._statistics is not None and self._armed else []

    def _legacy_key(self, key: str) -> bool:
        return key in ("statistics_steps", "inverse_step") or key.endswith(_STATE_SUFFIXES)

    def setup(self, optimizer: Any) -> None:
        self._check_sharded_layers(optimizer)
        self._statistics = self._make_statistics(self._layers())
        self._armed = any(_statistics_due(group) for group in optimizer.param_groups)

    def _make_statistics(self, layers: list[Layer]) -> FactorSums:
        return self.statistics(layers)

    def _layers(self) -> list[Layer]:
        """The layers this rule preconditions: those the optimizer trains whose kind has its capability, but
        for those it excludes (``max_dim``)."""
        assert self.layers is not None
        return [layer for layer in self.optimizer.layers(self.layers) if self.excluded(layer) is None]

    def excluded(self, layer: Layer) -> str | None:
        """Why the rule leaves ``layer`` to the stock update (a factor over ``max_dim``), or ``None``."""
        if self._max_dim is None:  # (matrix_shape fails on a layer of width 0)
            return None
        size = max(_sides(layer)[factor] for factor in self.factors)
        if size <= self._max_dim:
            return None
        return f"a Kronecker factor of size {size} exceeds max_dim={self._max_dim} (memory ~ size², time ~ size³)"

    def treatment(self, optimizer: Any, param: Tensor, module: nn.Module | None) -> tuple[str, str | None, bool]:
        assert self.layers is not None
        return layer_treatment(optimizer, param, module, self.layers, f"{self.label}: Kronecker", self.excluded)

    def check_group(self, group: dict[str, Any]) -> None:
        if not 0.0 <= group["damping"] < math.inf:
            raise ValueError(f"Invalid damping: {group['damping']} (must be finite and >= 0)")
        if not 0.0 <= group["stat_decay"] < 1.0:
            raise ValueError(f"Invalid stat_decay: {group['stat_decay']} (must be in [0, 1))")
        for name in ("update_every", "statistics_every"):
            if not _positive_integer(group[name]):
                raise ValueError(f"Invalid {name}: {group[name]!r} (must be an integer >= 1)")
        if group.get("loss_reduction", "mean") not in ("mean", "sum"):
            raise ValueError(f"Invalid loss_reduction: {group['loss_reduction']!r} (choose 'mean' or 'sum')")

    def _check_sharded_layers(self, optimizer: Any) -> None:
        """Refuse, by name, a sharded layer whose gradient matrix this rule cannot precondition: split by tensor
        parallelism other than as ``_tensor_parallel_problem`` allows, or (FSDP2) not sharded by rows."""
        names = module_names(optimizer.model)
        layout = ParallelLayout(optimizer.model)
        for module in optimizer._modules_to_capture(optimizer._params()):
            kind = layer_kind(module)
            if kind is None or self.layers is None or not kind.provides(self.layers):
                continue
            weight, bias = weight_of(module), bias_of(module)
            if not any(sharded(t) for t in (weight, bias) if t is not None):
                continue
            name = names.get(module) or type(module).__name__
            style = tensor_parallel_style(layout, weight, bias)
            if style is not None:
                problem = self._tensor_parallel_problem(style, module, kind) or _data_rows_problem(layout, weight, bias)
                if problem is not None:
                    raise NotImplementedError(
                        f"{self.label} cannot precondition {name} under tensor parallelism: {problem}. "
                        f"{self._tensor_parallel_advice}, or leave it out of the optimizer's params"
                    )
                continue
            problem = row_sharding_problem(weight, bias)
            if problem is None and (type(kind) not in (LinearKind, ConvKind) or getattr(module, "groups", 1) != 1):
                problem = "only nn.Linear and nn.Conv1d/2d/3d (groups=1) have gradient matrices sharded by rows"
            if problem is not None:
                raise NotImplementedError(
                    f"{self.label} cannot precondition {name} "
                    f"under FSDP2: {problem}. Shard it with fully_shard's default "
                    "placement (Shard(0) over a 1-D mesh), or leave it out of the optimizer's params"
                )

    _tensor_parallel_advice: ClassVar[str] = "Parallelize it with ColwiseParallel"

    def _tensor_parallel_problem(self, style: str, module: nn.Module, kind: LayerKind) -> str | None:
        """Why this rule cannot precondition a layer tensor parallelism splits as ``style`` (``None``: it can).
        A rule acting on rows of ``G̃`` (FOOF) takes a column-sharded ``nn.Linear`` as it is: each rank sees the
        whole input (the input factor is the whole one) and holds whole rows of ``G̃``."""
        if style == "columns" and type(kind) is LinearKind and self.acts_on_rows:
            return None
        if style == "columns" and type(kind) is LinearKind:
            return (
                "ColwiseParallel splits its output features over the ranks, and the output-gradient factor "
                "(G = E[g gᵀ] over every output feature) couples them all; gathering the output gradients is not "
                "implemented"
            )
        if style == "rows" and type(kind) is LinearKind:
            return (
                "RowwiseParallel splits its input features over the ranks, and the input factor (A = E[x̃ x̃ᵀ] over "
                "every input feature) couples them all; gathering the inputs is not implemented (nor is the "
                "block-diagonal approximation, one block per rank's features)"
            )
        return tensor_parallel_problem(style, module, kind)

    def _precondition(
        self, layer: Layer, matrix: Tensor, inverses: dict[str, Tensor], rows: slice = slice(None)
    ) -> Tensor:
        """Rows ``rows`` of the preconditioned ``matrix``."""
        raise NotImplementedError

    def _local_sums(self, layer: Layer, sums: Sums) -> Sums:
        """This rank's factor sums of the step, before they are summed over ranks."""
        return sums

    def _damping(self, group: dict[str, Any], factor: str, means: dict[str, Tensor]) -> float | Tensor:
        """What is added to the diagonal of ``factor`` before inverting it; ``means`` holds each
        factor's mean eigenvalue (one per block)."""
        return float(group["damping"])

    def _initial_moment(self, moment: Tensor) -> Tensor | None:
        """The running average a factor's first moment is averaged with (``None``: it is taken as is)."""
        return None

    def update(self, optimizer: Any, inputs: Inputs) -> None:
        """Precondition the gradients of the supported layers."""
        # (not armed for this step's forward: statistics_every changed since; a step between statistics)
        armed = self._statistics is not None and self._statistics in optimizer.capture.reductions
        due = [group for group in optimizer.param_groups if armed and _statistics_due(group)]
        layers, sums = self._step_statistics(inputs, due) if due else ([], [])
        self._precondition_layers(due, layers, sums)

    def advance(self, optimizer: Any) -> None:
        for group in optimizer.param_groups:
            group["schedule_step"] = group.get("schedule_step", 0) + 1
        self._armed = any(_statistics_due(group) for group in optimizer.param_groups)  # read by the next forward

    def _precondition_layers(self, due: list[dict[str, Any]], layers: list[Layer], sums: list[Sums]) -> None:
        """Precondition the layers that saw rows this step (``layers``, with their factor sums) and
        those whose group is between statistics steps (with the kept inverses)."""
        # Every inverse is computed (and may fail) before any gradient or state changes: no half step.
        try:
            updates = [self._refreshed(layer, factor_sums) for layer, factor_sums in zip(layers, sums, strict=True)]
            self._invert_due(layers, updates)
            kept = [
                (layer, {f: self._kept_inverse(layer, f, k) for f, k in zip(self.factors, inverses, strict=True)})
                for layer, inverses in self._between_statistics(due, [self._key(f) for f in self.factors])
            ]
            checks = [
                self._check(layer, inverses, moments, bases)
                for layer, (_, moments, inverses, _, bases) in zip(layers, updates, strict=True)
            ]
            checks += [self._check(layer, inverses, {}, {}) for layer, inverses in kept]
            refuse_any([check for check in checks if check is not None])  # (one host read for every layer)
        except _NotPositiveDefinite as error:  # a diverged run is said as such before any advice on damping
            self._refuse_not_finite_gradients(error)
            raise
        for layer, update in zip(layers, updates, strict=True):
            self._set_preconditioned(layer, self._commit_statistics(layer, update))
        for layer, inverses in kept:
            self._keep_inverses(layer, inverses)  # (under "eigh", those a change of damping formed anew)
            self._set_preconditioned(layer, inverses)

    def _check(
        self,
        layer: Layer,
        inverses: dict[str, Tensor],
        moments: dict[str, Tensor],
        bases: dict[str, tuple[Tensor, Tensor]],
    ) -> Check | None:
        """What to check before any change of a layer whose step inverts a matrix formed this step (a refresh, or a
        new damping under ``"eigh"``: ``moments`` and ``bases`` are this step's; a kept one was checked when
        formed): the condition number of the Kronecker product of its damped factors (FOOF's one factor), or what
        ``_eigenvalue_condition`` says under ``"eigh"``, against ``inverses.condition_limit``."""
        state = self.state[weight_of(layer.module)]
        if all(state.get(self._key(f)) is inverses[f] for f in self.factors):
            return None
        dtypes = (self._inverse_dtype, inverses[self.factors[0]].dtype)  # (inverted in, kept and applied in)
        name = f"{self.optimizer.capture.name(layer.module)} ({' ⊗ '.join(reversed(self.factors))})"
        damping = float(layer.group["damping"])
        if self._inverse == "eigh":
            values = {f: bases[f][0] if f in bases else state[f"{f}_eigenvalues"] for f in self.factors}
            return Check(self._eigenvalue_condition(layer, values), None, dtypes, name, damping, [])
        means = {f: m.diagonal(dim1=-2, dim2=-1).mean(-1) for f, m in moments.items()}
        damped = [(moments[f], self._damping(layer.group, f, means), inverses[f]) for f in self.factors]
        bound = torch.stack([condition(matrix, lam, inverse) for matrix, lam, inverse in damped]).prod(0)

        def exact() -> Tensor:
            return torch.stack([condition(matrix, lam) for matrix, lam, _ in damped]).prod(0)

        def failed() -> None:  # (each factor inverted again, checked: the one that fails says so)
            for factor, (matrix, lam, _) in zip(self.factors, damped, strict=True):
                label = f"{self.optimizer.capture.name(layer.module)} ({factor})"
                damped_inverse(matrix, lam, label, dtype=self._inverse_dtype, given=damping)

        return Check(bound, exact, dtypes, name, damping, list(moments.values()), failed)

    def _eigenvalue_condition(self, layer: Layer, values: dict[str, Tensor]) -> Tensor:
        """The condition number of the matrix a step inverts, from its factors' eigenvalues ``values``: the
        Kronecker product of the damped factors'."""
        means = {f: v.mean(-1) for f, v in values.items()}
        shifted = [v + torch.as_tensor(self._damping(layer.group, f, means))[..., None] for f, v in values.items()]
        return torch.stack([eigenvalue_condition(s) for s in shifted]).prod(0)

    def _commit_statistics(self, layer: Layer, update: Any) -> dict[str, Tensor]:
        """Keep a statistics step's moments, decompositions and inverses; return the inverses."""
        state, moments, inverses, due, bases = update
        if due:  # refreshed (kept only now: a step that fails changes no state)
            state["inverse_step"] = layer.group.get("schedule_step", 0)
        for factor in self.factors:
            state[f"{factor}_second_moment"] = moments[factor]
            if factor in bases:
                state[f"{factor}_eigenvalues"], state[f"{factor}_eigenvectors"] = bases[factor]
        self._keep_inverses(layer, inverses)
        state["statistics_steps"] = state.get("statistics_steps", 0) + 1
        return inverses

    def _refuse_not_finite_gradients(self, error: Exception) -> None:
        """Raise, from ``error``, naming the first layer whose gradient is not finite, if there is one."""
        for layer in self._layers():
            for param in (weight_of(layer.module), bias_of(layer.module)):
                grad = None if param is None else param.grad
                if grad is not None and not bool(torch.isfinite(local_tensor(grad)).all()):
                    raise RuntimeError(
                        f"the gradient of {self.optimizer.capture.name(layer.module)} is not finite: training has "
                        "diverged (NaN or inf activations or gradients), which no damping cures. Lower the learning "
                        "rate. No parameter was changed by this step"
                    ) from error

    def _between_statistics(self, due: list[dict[str, Any]], keys: list[str]) -> list[tuple[Layer, list[Tensor]]]:
        """The layers with a gradient in groups that collect no statistics this step, with their state
        under ``keys`` (a layer missing any, none kept yet, takes the plain step)."""
        out = []
        for layer in self._layers():
            weight = weight_of(layer.module)
            if weight.grad is None or any(layer.group is group for group in due):
                continue
            state = self.state.get(weight, {})
            if all(key in state for key in keys):
                out.append((layer, [state[key] for key in keys]))
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        optimizer = self.optimizer
        steps = max((g.get("schedule_step", 0) for g in optimizer.param_groups), default=0)
        if steps and self._layers() and not any("statistics_steps" in e for e in self.state.values()):
            raise ValueError(
                f"{type(optimizer).__name__}.load_state_dict: the state took {steps} steps but holds no layer's "
                "statistics. A checkpointer that loads into the keys a fresh optimizer has leaves them out: "
                "torch.distributed.checkpoint's template from get_optimizer_state_dict holds what one step on zero "
                "gradients creates. Take one training step before building the template, or save state_dict() "
                "whole. Nothing was loaded"
            )

    def _set_preconditioned(self, layer: Layer, inverses: dict[str, Tensor]) -> None:
        """Replace the layer's gradient by the preconditioned one (under FSDP2, this rank's rows of it)."""
        module, kind, homogeneous = layer.module, layer.kind, layer.homogeneous
        weight = weight_of(module)
        if not sharded(weight):
            new = self._precondition(layer, kind.grad_matrix(module, homogeneous), inverses)
            kind.set_grad_matrix(module, new, homogeneous)
            return
        bias = bias_of(module)
        if self.acts_on_rows:  # this rank's rows need nothing from the others
            new = self._precondition(layer, local_matrix_rows(weight, bias, homogeneous), inverses)
        else:  # rows mix: gather this layer's gradient, keep this rank's rows of the result
            full = full_matrix_rows(weight, bias, homogeneous)
            new = self._precondition(layer, full, inverses, row_range(weight))
        set_local_matrix_rows(weight, bias, new, homogeneous)

    def _step_statistics(self, inputs: Inputs, due: list[dict[str, Any]]) -> tuple[list[Layer], list[Sums]]:
        """This step's factor sums, summed over ranks, of the layers of the ``due`` groups with a gradient
        and a row this step (an expert no token was routed to keeps its running moments)."""
        assert self._statistics is not None
        totals = inputs.reduced(self._statistics)
        layers = [layer for layer in self._layers() if _takes_statistics(layer, due)]
        return summed_over_ranks(
            inputs, totals, layers, self._zero_sums, self.optimizer.data_parallel_group, self._local_sums
        )

    def _zero_sums(self, layer: Layer) -> Sums:
        """Zero factor sums of ``layer`` (Eva's factors are vectors, with nothing to invert)."""
        sides = _sides(layer)
        return zero_sums(layer, {factor: (sides[factor],) * (2 if self.inverts else 1) for factor in self.factors})

    def _kept_inverse(self, layer: Layer, factor: str, inverse: Tensor) -> Tensor:
        """The kept ``inverse`` of ``factor``; under ``inverse="eigh"``, formed again from the kept
        eigendecomposition if the damping changed since (a matrix product, no decomposition)."""
        if self._inverse != "eigh":
            return inverse
        state = self.state[weight_of(layer.module)]
        if state.get(f"{factor}_inverse_damping") == float(layer.group["damping"]):
            return inverse
        values, vectors = state[f"{factor}_eigenvalues"], state[f"{factor}_eigenvectors"]
        means = {f: state[f"{f}_eigenvalues"].mean(-1) for f in self.factors}  # (of the kept decompositions)
        damping = self._damping(layer.group, factor, means)
        name = f"{self.optimizer.capture.name(layer.module)} ({factor})"
        given = layer.group["damping"]
        return inverse_from_eigenbasis(
            values, vectors, damping, name, inverse.dtype, given, checked=False, power=self.power
        )

    def _key(self, factor: str) -> str:
        """The state key of ``factor``'s kept inverse (or inverse root)."""
        return f"{factor}_{self.kept_as}"

    def _keep_inverses(self, layer: Layer, inverses: dict[str, Tensor]) -> None:
        state = self.state[weight_of(layer.module)]
        for factor, inverse in inverses.items():
            if state.get(self._key(factor)) is inverse:
                continue  # (kept as it is: no refresh, no change of damping)
            state[self._key(factor)] = inverse
            if self._inverse == "eigh":
                state[f"{factor}_inverse_damping"] = float(layer.group["damping"])

    def _refreshed(
        self, layer: Layer, factor_sums: Sums
    ) -> tuple[dict[str, Any], dict[str, Tensor], dict[str, Tensor], list[str], dict[str, tuple[Tensor, Tensor]]]:
        """The layer's state, its new running moments, its kept inverses, the factors due for
        inversion, and (filled in by ``_invert_due`` under ``"eigh"``) their eigendecompositions."""
        state = self.state[weight_of(layer.module)]
        group = layer.group
        # update_every counts optimizer steps (as kfac-pytorch's inv_update_steps): the first statistics
        # step at least that many steps after the last refresh refreshes the inverses.
        step = group.get("schedule_step", 0)
        refresh = "inverse_step" not in state or step - state["inverse_step"] >= group["update_every"]
        moments, inverses, due = {}, {}, []
        for factor, (numerator, denominator) in factor_sums.items():
            moment = numerator / denominator  # (out of place: the sums may be the capture's totals)
            previous = state.get(f"{factor}_second_moment")
            moment = running_average(self._initial_moment(moment) if previous is None else previous, moment, group)
            if self._key(factor) not in state or refresh:
                due.append(factor)
            else:
                inverses[factor] = self._kept_inverse(layer, factor, state[self._key(factor)])
            moments[factor] = moment
        return state, moments, inverses, due, {}

    def _invert_due(self, layers: list[Layer], updates: list[Any]) -> None:
        """Fill in the inverses due this step (and under ``"eigh"`` their eigendecompositions): each
        on one rank and broadcast (``distributed_inversion``), or every one here."""
        jobs, likes, costs, slots = [], [], [], []
        dtype = self._inverse_dtype
        for layer, (_, moments, inverses, due, bases) in zip(layers, updates, strict=True):
            means = {f: m.diagonal(dim1=-2, dim2=-1).mean(-1) for f, m in moments.items()} if due else {}
            for factor in due:
                moment, n = moments[factor], moments[factor].shape[-1]
                name = f"{self.optimizer.capture.name(layer.module)} ({factor})"
                damping, given = self._damping(layer.group, factor, means), layer.group["damping"]
                if self._inverse == "eigh":  # the decomposition travels, packed as (n + 1) x n
                    jobs.append(functools.partial(eigenbasis, moment, name, dtype))
                    likes.append(moment.new_empty((*moment.shape[:-2], n + 1, n), dtype=dtype))
                else:
                    job = functools.partial(
                        damped_inverse, moment, damping, name, dtype=dtype, given=given, checked=False
                    )
                    jobs.append(job)  # (the condition number is the layer's: _check_inverted)
                    likes.append(moment)
                costs.append(float(moment.numel() * n))  # ~ n³ per block either way
                slots.append((inverses, bases, factor, name, damping, given, moment.dtype))
        group = self.optimizer.data_parallel_group if self._distributed_inversion else None
        results = computed_once(jobs, likes, costs, group)
        for (inverses, bases, factor, name, damping, given, like), result in zip(slots, results, strict=True):
            if self._inverse == "eigh":
                values, vectors = result[..., -1, :].clone(), result[..., :-1, :].clone()
                bases[factor] = (values, vectors)
                result = inverse_from_eigenbasis(
                    values, vectors, damping, name, like, given, checked=False, power=self.power
                )
            inverses[factor] = result


def tensor_parallel_problem(style: str, module: nn.Module, kind: LayerKind) -> str:
    """Why a rule reading a layer's inputs cannot follow how tensor parallelism splits it (``style``, as
    ``tensor_parallel_style`` says)."""
    if type(kind) is not LinearKind:
        return f"only nn.Linear is supported split by tensor parallelism, and this {type(module).__name__} is ({style})"
    if style == "replicated":
        return (
            "its weight is replicated over the tensor-parallel ranks, whose inputs may each hold part of the "
            "sequence (SequenceParallel), so no rank sees all the rows a statistic is taken over"
        )
    if style in ("columns", "rows"):
        return f"its weight is split on its {'output' if style == 'columns' else 'input'} features"
    return f"its weight and bias are {style}, split neither on output features nor on input features alone"


def _data_rows_problem(layout: ParallelLayout, weight: Tensor, bias: Tensor | None) -> str | None:
    """Why FSDP2's share of a column-sharded layer (under FSDP2 x tensor parallelism) does not hold whole rows
    of ``W̃`` (sharded on dim 0, the weight's and the bias's alike), or ``None``."""
    tensors = [weight] if bias is None else [weight, bias]
    for t in tensors:
        dims = layout.data_dims(t)
        if len(dims) > 1:
            return "FSDP2 shards it over a 2-D mesh (HSDP), whose statistics would be combined over one dimension only"
        if any(shard_dim(t.placements[d]) != 0 for d in dims):  # type: ignore[attr-defined]
            return f"FSDP2 shards it as {tuple(t.placements)}, not on rows"  # type: ignore[attr-defined]
    if bias is not None and local_tensor(weight).shape[0] != local_tensor(bias).shape[0]:
        return "this rank holds different rows of the weight and of the bias"
    return None


def running_average(previous: Tensor | None, new: Tensor, group: dict[str, Any]) -> Tensor:
    """``beta * previous + (1 - beta) * new`` (``beta`` the group's ``stat_decay``; no ``previous``: ``new``),
    in ``new``'s dtype (the model may have changed dtype since: ``model.double()``)."""
    return new if previous is None else torch.lerp(previous.to(new.dtype), new, 1 - group["stat_decay"])


def summed_over_ranks(
    inputs: Inputs,
    totals: dict[Tensor, Sums],
    layers: list[Layer],
    zeros: Callable[[Layer], Sums],
    ranks: Any,
    local: Callable[[Layer, Sums], Sums] = lambda layer, sums: sums,
) -> tuple[list[Layer], list[Sums]]:
    """The layers some rank saw a row of, and their sums from ``totals`` (by weight) through ``local``, summed
    over ``ranks``. A layer this rank's batch never reached joins with ``zeros(layer)`` (every rank reduces the
    same list); one captured on no rank takes the plain step (``Inputs`` warns)."""
    joined: list[Layer] = []
    sums: list[Sums] = []
    absent: list[int] = []  # (indices of the layers this rank captured no call of)
    for layer in layers:
        weight = weight_of(layer.module)
        found = totals.get(weight)
        if found is None:  # nothing captured here
            if ranks is None:  # the plain step for this layer (Inputs warns)
                inputs.uncaptured(weight)
                continue
            absent.append(len(joined))
            found = zeros(layer)
        joined.append(layer)
        if ranks is not None:  # copies, summed in place: the capture's totals stay as they are for a retry
            found = {f: (n.clone(), d) for f, (n, d) in found.items()}
        sums.append(local(layer, found))
    if ranks is not None and sums:
        sums = _summed(sums, ranks)
    for index in absent:  # captured on no rank: the plain step
        if all(d == 0 for _, d in sums[index].values()):
            inputs.uncaptured(weight_of(joined[index].module))
    seen = [(layer, s) for layer, s in zip(joined, sums, strict=True) if all(d > 0 for _, d in s.values())]
    return [layer for layer, _ in seen], [s for _, s in seen]


def _summed(sums: list[Sums], ranks: Any) -> list[Sums]:
    """``sums`` added over ``ranks`` in one collective; their counts (numbers on each rank) read back at once:
    the step's one host read of them."""
    numerators = [n for layer_sums in sums for n, _ in layer_sums.values()]
    counts = torch.tensor(
        [float(d) for layer_sums in sums for _, d in layer_sums.values()],
        dtype=torch.float64,
        device=local_tensor(numerators[0]).device,
    )
    all_reduce_sum_([*numerators, counts], ranks)
    read = iter(counts.tolist())
    return [{f: (n, next(read)) for f, (n, _) in layer_sums.items()} for layer_sums in sums]


def zero_sums(layer: Layer, shapes: dict[str, tuple[int, ...]]) -> Sums:
    """Zero sums of ``layer``, shaped as the hooks compute them: each factor's numerator of its shape in
    ``shapes`` (per block if the layer has several), its denominator a number."""
    weight = local_tensor(weight_of(layer.module))
    dtype = torch.promote_types(weight.dtype, torch.float32)  # (as the statistics of its inputs)
    blocks = layer.kind.blocks(layer.module)
    lead = (blocks,) if blocks > 1 else ()
    zero = functools.partial(torch.zeros, dtype=dtype, device=weight.device)
    return {factor: (zero((*lead, *shape)), 0.0) for factor, shape in shapes.items()}


def _statistics_due(group: dict[str, Any]) -> bool:
    return group.get("schedule_step", 0) % group["statistics_every"] == 0


def _sides(layer: Layer) -> dict[str, int]:
    """The width of each side of the layer's gradient matrix, by the factor it gives."""
    outputs, inputs = layer.kind.matrix_shape(layer.module, layer.homogeneous)
    return {"input": inputs, "output_grad": outputs}


def _positive_integer(value: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def _takes_statistics(layer: Layer, due: list[dict[str, Any]]) -> bool:
    """Whether ``layer`` is in a ``due`` group and has its gradients (a layer of width 0 is
    preconditioned trivially, by the stock step)."""
    weight, bias = weight_of(layer.module), bias_of(layer.module)
    if weight.grad is None or (bias is not None and layer.homogeneous and bias.grad is None):
        return False
    return any(layer.group is group for group in due) and weight.numel() > 0
