"""Eva: rank-one Kronecker preconditioning from the layers' mean input and output-gradient vectors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ._torch import foreach_norm
from .distributed import ParallelLayout
from .inverses import condition_limit, refuse_ill_conditioned
from .kfac import KroneckerFactors
from .kronecker import KroneckerPreconditioner, Sums, running_average
from .layers import Layer, LayerKind, LinearKind, weight_of
from .sgd import SGDWithRule

__all__ = ["Eva", "EvaPreconditioner"]


class KroneckerVectors(KroneckerFactors):
    """K-FAC's sums with vectors for matrices: the sums of the rows (Eva keeps no matrix)."""

    @staticmethod
    def side(rows: Tensor) -> Tensor:
        return rows.sum(-2)


class EvaPreconditioner(KroneckerPreconditioner):
    r"""Eva's transform of the gradients (``Eva``'s docstring has the rule and its arguments): each layer's
    gradient preconditioned by its rank-one Kronecker vectors, then KL-clipped. Chain it in front of any stock
    optimizer."""

    label = "Eva"
    factors = ("input", "output_grad")
    statistics = KroneckerVectors
    inverts = False
    layers = "output_grad_rows"  # layers with both sides (not MultiheadAttention's in_proj)

    def __init__(
        self,
        damping: float = 0.03,
        stat_decay: float = 0.95,
        kl_clip: float | None = 0.001,
        *,
        statistics_every: int = 1,
        loss_reduction: str = "mean",
        damping_form: str = "kronecker",
        max_dim: int | None = None,
        distributed_inversion: bool = False,
    ) -> None:
        if damping_form not in DAMPING_FORMS:
            raise ValueError(
                f"Invalid damping_form: {damping_form!r} (must be one of {', '.join(map(repr, DAMPING_FORMS))})"
            )
        self._direction = DAMPING_FORMS[damping_form]
        self.defaults = {"loss_reduction": loss_reduction, "kl_clip": kl_clip}
        super().__init__(
            damping,
            stat_decay,
            1,
            statistics_every=statistics_every,
            max_dim=max_dim,
            distributed_inversion=distributed_inversion,
        )

    def check_group(self, group: dict[str, Any]) -> None:
        if not group["damping"] > 0.0:  # a rank-one factor is singular without it
            raise ValueError(f"Invalid damping: {group['damping']} (must be > 0)")
        if group["kl_clip"] is not None and not 0.0 < group["kl_clip"] < math.inf:
            raise ValueError(f"Invalid kl_clip: {group['kl_clip']} (must be None or finite and > 0)")
        super().check_group(group)

    _tensor_parallel_advice = (
        "Train tensor-parallel layers with FOOF (ColwiseParallel ones) or NLMS (ColwiseParallel and RowwiseParallel)"
    )

    def _tensor_parallel_problem(self, style: str, module: nn.Module, kind: LayerKind) -> str | None:
        if style in ("columns", "rows") and isinstance(kind, LinearKind):
            side = "output" if style == "columns" else "input"
            return (
                f"{'Colwise' if style == 'columns' else 'Rowwise'}Parallel splits its {side} features over the ranks, "
                f"and Eva's {side}-side vector and the product gᵀ G̃ a span every rank's features; combining them "
                "is not implemented"
            )
        return super()._tensor_parallel_problem(style, module, kind)

    def _check_sharded_layers(self, optimizer: Any) -> None:
        super()._check_sharded_layers(optimizer)  # (tensor parallelism: refused by name there)
        layout = ParallelLayout(optimizer.model)
        if any(layout.data_dims(p) for p in optimizer._params()):
            raise NotImplementedError(
                "Eva does not support FSDP2-sharded parameters yet: its output-side vector mixes the "
                "rows of each weight's gradient. Use DistributedDataParallel, or InputAwareAdamW / InputAwareSGD / "
                "LazyAdamW under FSDP2"
            )

    def _local_sums(self, layer: Layer, sums: Sums) -> Sums:
        # As K-FAC: a mean-reduced loss divides each output gradient by this rank's batch B, so
        # Ds = B g; summing (B sum g) and B over ranks, then dividing, gives the mean of Ds.
        grads, batch = sums["output_grad"]
        if layer.group["loss_reduction"] == "mean":
            grads = grads * batch
        return {**sums, "output_grad": (grads, batch)}

    def _precondition_layers(self, due: list[dict[str, Any]], layers: list[Layer], sums: list[Sums]) -> None:
        """Replace each supported layer's gradient by its Kronecker-vector direction, KL-clipped
        (a layer with no row this step keeps its state)."""
        vectors = [self._running_means(layer, s) for layer, s in zip(layers, sums, strict=True)]
        updated, kept = len(layers), self._between_statistics(due, ["input_mean", "output_grad_mean"])
        layers, vectors = layers + [layer for layer, _ in kept], vectors + [(a, g) for _, (a, g) in kept]
        # (in float32 at least, rounded once into a half-precision gradient: as FOOF's and K-FAC's products)
        matrices = [_at_least_float32(layer.kind.grad_matrix(layer.module, layer.homogeneous)) for layer in layers]
        directions = [
            self._direction(m, a.to(m.dtype), g.to(m.dtype), float(layer.group["damping"]))
            for layer, m, (a, g) in zip(layers, matrices, vectors, strict=True)
        ]
        conditions = [  # (checked with the directions, in the same transfer to the host)
            (self._damped_condition(layer, a, g), (a.dtype, m.dtype))
            for layer, m, (a, g) in zip(layers, matrices, vectors, strict=True)
        ]
        scale = self._checked_scale(layers, matrices, directions, conditions)
        for index, (layer, (a, g), direction) in enumerate(zip(layers, vectors, directions, strict=True)):
            if index < updated:
                state = self.state[weight_of(layer.module)]
                state["input_mean"], state["output_grad_mean"] = a, g
                state["statistics_steps"] = state.get("statistics_steps", 0) + 1
            nu = 1.0 if layer.group["kl_clip"] is None else scale
            layer.kind.set_grad_matrix(layer.module, direction * nu if nu != 1.0 else direction, layer.homogeneous)

    def _damped_condition(self, layer: Layer, a: Tensor, g: Tensor) -> Tensor:
        """The condition number of the matrix Eva inverts in closed form (one per block), held to the contract of
        ``inverses`` as FOOF's and K-FAC's inverses are: ``ḡḡᵀ ⊗ āāᵀ + γI`` (eigenvalues γ, and
        ``|ḡ|²|ā|² + γ`` once) or, under ``damping_form="factors"``, ``(ḡḡᵀ + γI) ⊗ (āāᵀ + γI)``."""
        damping = float(layer.group["damping"])
        g2, a2 = (torch.linalg.vector_norm(v, dim=-1, dtype=torch.float64) ** 2 for v in (g, a))
        if self._direction is eva_direction:
            return _rank_one_condition(g2 * a2, g.shape[-1] * a.shape[-1], damping)
        return _rank_one_condition(g2, g.shape[-1], damping) * _rank_one_condition(a2, a.shape[-1], damping)

    def _running_means(self, layer: Layer, sums: Sums) -> tuple[Tensor, Tensor]:
        state = self.state[weight_of(layer.module)]
        a, g = (running_average(state.get(f"{f}_mean"), sums[f][0] / sums[f][1], layer.group) for f in self.factors)
        return a, g

    def _checked_scale(
        self,
        layers: list[Layer],
        matrices: list[Tensor],
        directions: list[Tensor],
        conditions: Sequence[tuple[Tensor, tuple[torch.dtype, ...]]],
    ) -> float:
        """The KL-clip scale, after one check of every direction and of every layer's ``conditions`` (against
        ``inverses.condition_limit`` of their dtypes), before any change (one transfer to the host for all).
        One scale for every clipped layer, whatever groups they are in (the KL clip bounds the whole update, as
        in the authors' code): so their ``kl_clip`` must agree."""
        clips = {group["kl_clip"] for group in self.optimizer.param_groups} - {None}
        if len(clips) > 1:
            raise ValueError(
                f"Eva's kl_clip bounds the KL divergence of the whole update, so every param group must use the "
                f"same value (or None: not clipped); they use {sorted(clips)}. No parameter was changed"
            )
        inners = [  # over the clipped layers: η² ⟨P, G̃⟩
            torch.vdot(direction.reshape(-1), matrix.reshape(-1)).double() * float(layer.group["lr"]) ** 2
            for layer, matrix, direction in zip(layers, matrices, directions, strict=True)
            if layer.group["kl_clip"] is not None
        ]
        total = 0.0
        if directions:
            # A norm is finite unless the direction holds a NaN or an inf (or its squares overflow: then
            # each element is checked).
            finite = torch.stack(foreach_norm(directions)).isfinite().all().double()
            worst = torch.stack([(c / condition_limit(*dtypes)).max() for c, dtypes in conditions]).max()
            zero = torch.zeros((), dtype=torch.float64, device=finite.device)
            is_finite, total, over = torch.stack([finite, sum(inners, zero), worst.to(finite.device)]).tolist()
            if not is_finite:
                for layer, direction in zip(layers, directions, strict=True):
                    if not bool(direction.isfinite().all()):
                        raise RuntimeError(
                            f"Eva's preconditioned gradient of {self.optimizer.capture.name(layer.module)} is not "
                            "finite: training has diverged (NaN or inf activations or gradients). Lower the learning "
                            "rate or raise damping. No parameter was changed by this step"
                        )
            if not over < 1.0:  # (a diverged run is said as such first)
                for layer, (condition, dtypes) in zip(layers, conditions, strict=True):
                    name = f"{self.optimizer.capture.name(layer.module)} (output_grad ⊗ input)"
                    refuse_ill_conditioned(condition, dtypes, name, float(layer.group["damping"]))
        total = abs(total)
        return 1.0 if not clips or total == 0.0 else min(1.0, math.sqrt(clips.pop() / total))


class Eva(SGDWithRule):
    r"""Eva (Zhang, Shi & Li, 2023): K-FAC with each factor replaced by a rank-one Kronecker vector.

    For each layer with a Kronecker form (``nn.Linear``, convolutions, Hugging Face ``Conv1D``,
    ...), with :math:`\tilde x_r` its input rows (a 1 appended when the bias is trained),
    :math:`g_r` the gradient that reached its output rows, :math:`B` the batch and
    :math:`\tilde G` the weight-and-bias gradient, the Kronecker vectors are the mean input row
    and the mean per-example output derivative (:math:`Ds = B g` for a mean loss), kept as
    running averages (decay ``stat_decay``; the first step takes its own):

    .. math::
        \bar a = \frac{1}{N_x}\sum_r \tilde x_r, \qquad \bar g = \frac{1}{B}\sum_r B g_r, \qquad
        \operatorname{vec} P = (\bar g \bar g^\top \otimes \bar a \bar a^\top + \gamma I)^{-1}\,
            \operatorname{vec} \tilde G, \qquad
        P = \frac{1}{\gamma}\Big(\tilde G - \frac{\bar g^\top \tilde G\, \bar a}
            {\gamma + \lVert \bar g\rVert^2 \lVert \bar a\rVert^2}\, \bar g \bar a^\top\Big)

    (one Sherman-Morrison step: no matrix is formed or inverted). Then all preconditioned
    gradients are scaled by the KL clip
    :math:`\nu = \min\big(1, \sqrt{\kappa / (\eta^2 \sum_\ell |\langle P_\ell, \tilde G_\ell\rangle|)}\big)`
    (``kl_clip`` :math:`\kappa`, learning rate :math:`\eta`: one :math:`\nu` over every clipped layer, whatever
    its param group, so the groups' ``kl_clip`` must agree) and the SGD momentum update runs.
    Other parameters take plain SGD. Differences from the authors' code: docs/rules/eva.md.

    State per preconditioned weight, in ``optimizer.rules[0].state[weight]``: ``input_mean``
    (:math:`\bar a`), ``output_grad_mean`` (:math:`\bar g`) and ``statistics_steps``.

    Args:
        model: The model.
        lr: Learning rate.
        momentum: SGD momentum (``None``: 0.9; with ``base=``, the base's own default).
        damping: :math:`\gamma` (> 0), added to the Kronecker product of the rank-one factors. A step with
            :math:`(\gamma + \lVert \bar g\rVert^2 \lVert \bar a\rVert^2) / \gamma` at or above
            ``inverses.condition_limit`` (8.4e5: the vectors and the product are float32 at least) is refused,
            changing nothing, as FOOF's and K-FAC's inverses are.
        stat_decay: Decay of the running vectors, in [0, 1).
        kl_clip: :math:`\kappa` (> 0), or ``None`` for no clipping (the authors' default, 0.001).
        statistics_every: Collect the vectors every this many steps (>= 1); the kept vectors between.
        loss_reduction: ``"mean"`` (over the batch, the inputs' first dimension) or ``"sum"``.
        damping_form: ``"kronecker"`` (default, as above) or ``"factors"``: :math:`\gamma` added to each
            factor, :math:`P = (\bar g \bar g^\top + \gamma I)^{-1} \tilde G (\bar a \bar a^\top + \gamma I)^{-1}`.
        max_dim: Leave layers with a larger side to the stock update (None: no limit).
        distributed_inversion: Accepted for the Kronecker rules' common signature; changes nothing.
        params: Parameters or param groups of ``model`` (default: all that require grad).
        **sgd_kwargs: Any other ``torch.optim.SGD`` argument, ``storage``, or ``base=`` (a stock
            optimizer class to take the update instead of SGD) and its arguments.

    Reference:
        Lin Zhang, Shaohuai Shi and Bo Li, "Eva: Practical Second-order Optimization with
        Kronecker-vectorized Approximation", ICLR 2023.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float | None = None,
        momentum: float | None = None,
        damping: float = 0.03,
        stat_decay: float = 0.95,
        kl_clip: float | None = 0.001,
        *,
        statistics_every: int = 1,
        loss_reduction: str = "mean",
        damping_form: str = "kronecker",
        max_dim: int | None = None,
        distributed_inversion: bool = False,
        params: Any = None,
        **sgd_kwargs: Any,
    ) -> None:
        for foreign in ("update_every", "inverse", "inverse_dtype"):
            if foreign in sgd_kwargs:
                raise TypeError(
                    f"Eva() got {foreign}=: Eva inverts no matrix (its inverses are closed-form, formed from "
                    "each statistics step's vectors), so it has no inverse schedule or method; leave it out "
                    "(statistics_every= sets how often the statistics are read)"
                )
        rule = EvaPreconditioner(
            damping,
            stat_decay,
            kl_clip,
            statistics_every=statistics_every,
            loss_reduction=loss_reduction,
            damping_form=damping_form,
            max_dim=max_dim,
            distributed_inversion=distributed_inversion,
        )
        self._construct(model, lr, momentum, rule, params, sgd_kwargs)


def eva_direction(matrix: Tensor, a: Tensor, g: Tensor, damping: float) -> Tensor:
    """:math:`(\\bar g \\bar g^\\top \\otimes \\bar a \\bar a^\\top + \\gamma I)^{-1} \\operatorname{vec} M` by
    Sherman-Morrison: ``(M - c g aᵀ) / γ`` with ``c = gᵀ M a / (γ + |g|² |a|²)``; with leading block
    dimensions (a grouped convolution), one per block."""
    scale = 1.0 / damping
    if matrix.dim() == 2:  # (the common case, in matrix-vector kernels)
        coefficient = torch.dot(g, torch.mv(matrix, a)) / torch.dot(g, g).mul(torch.dot(a, a)).add_(damping)
        return torch.addr(matrix, g * coefficient, a, beta=scale, alpha=-scale)
    blocks = matrix.reshape(-1, *matrix.shape[-2:])  # one product per block
    a, g = a.reshape(blocks.shape[0], -1, 1), g.reshape(blocks.shape[0], -1, 1)
    numerator = torch.bmm(g.mT, torch.bmm(blocks, a))
    coefficient = numerator / torch.bmm(g.mT, g).mul(torch.bmm(a.mT, a)).add_(damping)
    return torch.baddbmm(blocks, g * coefficient, a.mT, beta=scale, alpha=-scale).reshape(matrix.shape)


def per_factor_direction(matrix: Tensor, a: Tensor, g: Tensor, damping: float) -> Tensor:
    """:math:`(g g^\\top + \\gamma I)^{-1} M (a a^\\top + \\gamma I)^{-1}` (``damping_form="factors"``) by
    Sherman-Morrison twice: ``R = M - u aᵀ``, ``u = M a / (γ + aᵀa)``, then ``(R - g vᵀ) / γ²``,
    ``v = Rᵀ g / (γ + gᵀg)``; with leading block dimensions, one per block."""
    scale = 1.0 / (damping * damping)
    if matrix.dim() == 2:
        u = torch.mv(matrix, a).div_(torch.dot(a, a).add_(damping))
        right = torch.addr(matrix, u, a, alpha=-1)
        v = torch.mv(right.T, g).div_(torch.dot(g, g).add_(damping))
        return torch.addr(right, g, v, beta=scale, alpha=-scale)
    blocks = matrix.reshape(-1, *matrix.shape[-2:])
    a, g = a.reshape(blocks.shape[0], 1, -1), g.reshape(blocks.shape[0], -1, 1)
    u = torch.bmm(blocks, a.mT).div_(torch.bmm(a, a.mT).add_(damping))
    right = torch.baddbmm(blocks, u, a, alpha=-1)
    v = torch.bmm(g.mT, right).div_(torch.bmm(g.mT, g).add_(damping))
    return torch.baddbmm(right, g, v, beta=scale, alpha=-scale).reshape(matrix.shape)


DAMPING_FORMS = {"kronecker": eva_direction, "factors": per_factor_direction}


def _rank_one_condition(square: Tensor, size: int, damping: float) -> Tensor:
    """``μ_max / μ_min`` of ``vvᵀ + γI`` of ``size`` (``square``: ``|v|²``): its eigenvalues are ``|v|² + γ``
    once and ``γ`` ``size - 1`` times."""
    top = square + damping
    return top / (damping if size > 1 else top)


def _at_least_float32(matrix: Tensor) -> Tensor:
    return matrix.to(torch.promote_types(matrix.dtype, torch.float32))
