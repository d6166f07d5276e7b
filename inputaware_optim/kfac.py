"""K-FAC: Kronecker-factored approximate curvature from inputs and output gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .distributed import local_call
from .inputs import Call, Captured
from .inverses import eigenvalue_condition
from .kronecker import FactorSums, KroneckerPreconditioner, Sums
from .layers import ConvKind, Layer, LinearKind, weight_of
from .sgd import SGDWithRule

CONVENTIONS = ("inputaware", "kfac-pytorch")  # the factors' scaling and damping (see KFAC's docstring)

__all__ = ["KFAC", "KFACPreconditioner"]


class KroneckerFactors(FactorSums):
    """Per call: the input factor's sums in the forward hook, the output-gradient factor's in backward.
    With ``per_position`` (kfac-pytorch's scaling), a convolution's rows are divided by its number of
    output positions ``L`` and the output-gradient sum is over rows, not samples."""

    grad_outputs = True

    def __init__(self, layers: list[Layer], per_position: bool = False) -> None:
        super().__init__(layers)
        self.per_position = per_position

    def forward(self, call: Call) -> Any:
        layer = self.layers[call.module]
        entry = Captured([local_call(call)])
        rows = layer.kind.input_rows(call.module, entry, layer.homogeneous)
        batch = float(layer.kind.batch_size(call.module, entry))
        count = float(rows.shape[-2])
        positions = rows.shape[-2] / batch if self.per_position and isinstance(layer.kind, ConvKind) else 1.0
        if positions != 1.0:
            rows = rows / positions
        return (self.side(rows), count), batch, positions

    def backward(self, call: Call, kept: Any) -> Any:
        (input_sum, rows), batch, positions = kept
        grads = self.layers[call.module].kind.output_grad_rows(call.module, Captured([local_call(call, grads=True)]))
        if positions != 1.0:  # (only with per_position)
            grads = grads / positions
        count = float(grads.shape[-2]) if self.per_position else batch
        return {"input": (input_sum, rows), "output_grad": (self.side(grads), float(count))}


class KFACPreconditioner(KroneckerPreconditioner):
    r"""K-FAC's transform of the gradients (``KFAC``'s docstring has the rule and its arguments):
    :math:`\tilde G \leftarrow (\bar G + \ldots)^{-1} \tilde G (\bar A + \ldots)^{-1}` for each layer with input
    and output-gradient rows. Chain it in front of any stock optimizer."""

    label = "KFAC"
    factors = ("input", "output_grad")
    statistics = KroneckerFactors
    layers = "output_grad_rows"  # layers with both sides (not MultiheadAttention's in_proj)
    _tensor_parallel_advice = (
        "Train tensor-parallel layers with FOOF (ColwiseParallel ones) or NLMS (ColwiseParallel and RowwiseParallel)"
    )

    def __init__(
        self,
        damping: float = 0.1,
        stat_decay: float = 0.95,
        update_every: int = 10,
        *,
        statistics_every: int = 1,
        loss_reduction: str = "mean",
        convention: str = "inputaware",
        max_dim: int | None = None,
        distributed_inversion: bool = False,
        inverse: str = "cholesky",
        inverse_dtype: torch.dtype = torch.float64,
    ) -> None:
        if convention not in CONVENTIONS:
            raise ValueError(f"Invalid convention: {convention!r} (must be one of {', '.join(map(repr, CONVENTIONS))})")
        self.defaults = {"loss_reduction": loss_reduction}
        self._kfac_pytorch = convention == "kfac-pytorch"
        super().__init__(
            damping,
            stat_decay,
            update_every,
            statistics_every=statistics_every,
            max_dim=max_dim,
            distributed_inversion=distributed_inversion,
            inverse=inverse,
            inverse_dtype=inverse_dtype,
        )

    def setup(self, optimizer: Any) -> None:
        if self._kfac_pytorch:
            self._refuse_outside_kfac_pytorch(optimizer)
        super().setup(optimizer)

    def _refuse_outside_kfac_pytorch(self, optimizer: Any) -> None:
        """Refuse, by name, a layer kfac-pytorch does not precondition: its convention says nothing of it."""
        for layer in optimizer.layers(self.layers):
            module = layer.module
            if isinstance(layer.kind, LinearKind) or (
                type(layer.kind) is ConvKind and isinstance(module, nn.Conv2d) and module.groups == 1
            ):
                continue  # (nn.Linear and what is one, as Hugging Face's Conv1D; nn.Conv2d with groups=1)
            groups = getattr(module, "groups", 1)
            kind = type(module).__name__ + (f" with groups={groups}" if groups != 1 else "")
            name = optimizer.capture.name(module)
            what = kind if name == type(module).__name__ else f"{name} ({kind})"
            raise ValueError(
                f"{self.label}(convention='kfac-pytorch') cannot precondition {what}: "
                "kfac-pytorch preconditions nn.Linear and nn.Conv2d with groups=1 only, so its convention (the "
                "factors' scaling by output positions) says nothing of this layer. Use convention='inputaware' (the "
                "default, which covers it), or give its parameters to another optimizer. Nothing was changed"
            )

    def _make_statistics(self, layers: list[Layer]) -> FactorSums:
        return KroneckerFactors(layers, self._kfac_pytorch)

    def _local_sums(self, layer: Layer, sums: Sums) -> Sums:
        # A mean-reduced loss divides each output gradient by this rank's batch B (all its micro-batches),
        # so Ds = B g: summing (B^2 sum g g^T) and B over ranks gives G = E[sum_t Ds Ds^T] whatever the split.
        grads, batch = sums["output_grad"]
        if layer.group["loss_reduction"] == "mean" and not self._kfac_pytorch:
            grads = grads * (batch * batch)
        return {**sums, "output_grad": (grads, batch)}

    def _damping(self, group: dict[str, Any], factor: str, means: dict[str, Tensor]) -> float | Tensor:
        damping = float(group["damping"])
        if self._kfac_pytorch:
            return damping
        a, g = means["input"], means["output_grad"]
        pi = torch.where((a > 0) & (g > 0), (a / g).sqrt(), 1.0)  # (1 where a factor is zero: no ratio)
        return damping**0.5 * (pi if factor == "input" else 1 / pi)

    def _initial_moment(self, moment: Tensor) -> Tensor | None:
        if not self._kfac_pytorch:
            return None
        return torch.eye(moment.shape[-1], dtype=moment.dtype, device=moment.device).expand_as(moment)

    def _precondition(
        self, layer: Layer, matrix: Tensor, inverses: dict[str, Tensor], rows: slice = slice(None)
    ) -> Tensor:
        if self._kfac_pytorch and self._inverse == "eigh":
            return self._kronecker_damped(layer, matrix)[rows]
        dtype = torch.promote_types(matrix.dtype, inverses["input"].dtype)  # (no half-precision product)
        return inverses["output_grad"][rows].to(dtype) @ matrix.to(dtype) @ inverses["input"].to(dtype)

    def _eigenvalue_condition(self, layer: Layer, values: dict[str, Tensor]) -> Tensor:
        if not self._kfac_pytorch:
            return super()._eigenvalue_condition(layer, values)
        # kfac-pytorch's "eigen" inverts Ḡ ⊗ Ā + λI, whose eigenvalues are d_G d_Aᵀ + λ
        products = values["output_grad"][..., :, None] * values["input"][..., None, :]
        return eigenvalue_condition(products + float(layer.group["damping"]), dims=2)

    def _kronecker_damped(self, layer: Layer, matrix: Tensor) -> Tensor:
        r""":math:`(\bar G \otimes \bar A + \lambda I)^{-1} \operatorname{vec} \tilde G` in the kept eigenbases:
        :math:`Q_G [(Q_G^\top \tilde G Q_A) / (d_G d_A^\top + \lambda)] Q_A^\top` (kfac-pytorch's "eigen")."""
        state = self.state[weight_of(layer.module)]
        values_a, vectors_a = state["input_eigenvalues"], state["input_eigenvectors"]
        values_g, vectors_g = state["output_grad_eigenvalues"], state["output_grad_eigenvectors"]
        rotated = vectors_g.mT @ matrix.to(vectors_a.dtype) @ vectors_a
        scaled = rotated / (values_g[..., :, None] * values_a[..., None, :] + float(layer.group["damping"]))
        return (vectors_g @ scaled @ vectors_a.mT).to(matrix.dtype)


class KFAC(SGDWithRule):
    r"""K-FAC (Martens & Grosse 2015; convolutions as in Grosse & Martens 2016).

    For each layer with input and output-gradient rows (``nn.Linear``, Hugging Face's ``Conv1D``,
    convolutions and their transposes; grouped: a block per group), with :math:`\tilde x` its input
    rows (a 1 appended when the bias is trained), :math:`g` the gradient at its output rows,
    :math:`B` the batch size and :math:`\tilde G` the weight-and-bias gradient, the default is

    .. math::
        A = \frac{1}{N_x}\sum_r \tilde x_r \tilde x_r^\top, \quad
        G = B \sum_r g_r g_r^\top, \quad
        \tilde G \leftarrow (\bar G + \tfrac{\sqrt\lambda}{\pi} I)^{-1}\, \tilde G\,
            (\bar A + \pi\sqrt\lambda I)^{-1}, \quad
        \pi = \sqrt{m_A / m_G}, \quad m_F = \operatorname{tr}(\bar F) / \dim \bar F

    (factored Tikhonov damping, their section 6.3; :math:`\pi = 1` where a factor is zero; :math:`G`
    is the second moment of the output derivative :math:`Ds = B g` of a mean loss), with running
    averages :math:`\bar A, \bar G` (decay ``stat_decay``; the first step takes its own) whose damped
    inverses are refreshed every ``update_every`` optimizer steps; then the SGD momentum update.
    Under FSDP2 each layer's gradient is gathered (a layer at a time), each rank keeping its rows.

    State per preconditioned weight, in ``optimizer.rules[0].state[weight]``: ``input_second_moment``,
    ``input_inverse``, ``output_grad_second_moment``, ``output_grad_inverse`` and ``statistics_steps``.

    Args:
        model: The model.
        lr: Learning rate.
        momentum: SGD momentum (``None``: 0.9; with ``base=``, the base's own default).
        damping: :math:`\lambda` (>= 0), split between the factors as above. A step whose damped Kronecker
            product (the product of the damped factors, or kfac-pytorch's eigen ``Ḡ ⊗ Ā + λI``) has a condition
            number at or above ``inverses.condition_limit`` (8.4e5 for float32 statistics) is refused, changing
            nothing, by either ``inverse``.
        stat_decay: Decay of the running factors, in [0, 1).
        update_every: Refresh the inverses every this many optimizer steps (>= 1).
        statistics_every: Collect statistics every this many steps (>= 1); the kept inverses between.
        loss_reduction: ``"mean"`` (over the batch, the inputs' first dimension) or ``"sum"``
            (:math:`g` is per example: :math:`G = \frac1B\sum_r g_r g_r^\top`).
        convention: ``"inputaware"`` (default, above) or ``"kfac-pytorch"``: kfac-pytorch's scaling, running
            averages from :math:`I` and absolute :math:`\lambda` (its methods "inverse" and "eigen" as ``inverse``
            "cholesky" and "eigh"; docs/rules/kfac.md).
        max_dim: Leave layers with a larger factor to the stock update (None: no limit).
        distributed_inversion: Under data parallelism, invert each factor on one rank and broadcast it.
        inverse: ``"cholesky"`` (default) or ``"eigh"`` (keeps each eigendecomposition, so a change
            of ``damping`` applies at the next step without a new one).
        inverse_dtype: Precision of the decomposition, ``torch.float64`` (default) or ``torch.float32``.
        params: Parameters or param groups of ``model`` (default: all that require grad).
        **sgd_kwargs: Any other ``torch.optim.SGD`` argument, ``storage``, or ``base=`` (a stock
            optimizer class to take the update instead of SGD) and its arguments.

    References:
        James Martens and Roger Grosse, "Optimizing Neural Networks with Kronecker-factored
        Approximate Curvature", ICML 2015. Roger Grosse and James Martens, "A Kronecker-factored
        approximate Fisher matrix for convolution layers", ICML 2016. J. Gregory Pauloski et al.,
        kfac-pytorch (github.com/gpauloski/kfac-pytorch), for ``convention="kfac-pytorch"``.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float | None = None,
        momentum: float | None = None,
        damping: float = 0.1,
        stat_decay: float = 0.95,
        update_every: int = 10,
        *,
        statistics_every: int = 1,
        loss_reduction: str = "mean",
        convention: str = "inputaware",
        max_dim: int | None = None,
        distributed_inversion: bool = False,
        inverse: str = "cholesky",
        inverse_dtype: torch.dtype = torch.float64,
        params: Any = None,
        **sgd_kwargs: Any,
    ) -> None:
        rule = KFACPreconditioner(
            damping,
            stat_decay,
            update_every,
            statistics_every=statistics_every,
            loss_reduction=loss_reduction,
            convention=convention,
            max_dim=max_dim,
            distributed_inversion=distributed_inversion,
            inverse=inverse,
            inverse_dtype=inverse_dtype,
        )
        self._construct(model, lr, momentum, rule, params, sgd_kwargs)
