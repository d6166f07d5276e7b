"""K-FAC: Kronecker-factored approximate curvature from inputs and output gradients."""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor, nn

from .inputs import Call, Captured
from .kronecker import FactorSums, KroneckerRule
from .layers import Layer

__all__ = ["KFAC"]


class KroneckerFactors(FactorSums):
    """Per call: the input factor's sums in the forward hook, the output-gradient factor's when
    the call's output gradient arrives in backward."""

    grad_outputs = True

    def forward(self, call: Call) -> Any:
        layer = self.layers[call.module]
        entry = Captured([call])
        rows = layer.kind.input_rows(call.module, entry, layer.homogeneous)
        batch = float(layer.kind.batch_size(call.module, entry))
        return (rows.mT @ rows, rows.new_tensor(float(rows.shape[-2]))), batch  # per block if grouped

    def backward(self, call: Call, kept: Any) -> Any:
        layer = self.layers[call.module]
        (input_sum, rows), batch = kept
        grads = layer.kind.output_grad_rows(call.module, Captured([call]))
        return {"input": (input_sum, rows), "output_grad": (grads.mT @ grads, grads.new_tensor(batch))}


class KFAC(KroneckerRule):
    r"""K-FAC (Martens & Grosse 2015; convolutions as in Grosse & Martens 2016).

    ``KFAC(model, lr, momentum=0.9, damping=0.1, stat_decay=0.95, update_every=10, *,
    statistics_every=1, batch_averaged=True, max_dim=None, distributed_inversion=False,
    inverse="cholesky", inverse_dtype=torch.float64, params=None, **sgd_kwargs)``

    For each layer with input and output-gradient rows (``nn.Linear``, Hugging Face's ``Conv1D``,
    ``nn.Conv1d/2d/3d`` and their transposes; a grouped convolution one block per group),
    with :math:`\tilde x` the input rows (a 1 appended when the bias is trained), :math:`g` the
    gradient that reached the layer's output (one row per sample and position), :math:`B` the
    batch size and :math:`\tilde G` the weight-and-bias gradient:

    .. math::
        A = \frac{1}{N_x}\sum_r \tilde x_r \tilde x_r^\top, \qquad
        G = B \sum_r g_r g_r^\top, \qquad
        \tilde G \leftarrow (\bar G + \sqrt{\lambda} I)^{-1}\, \tilde G\, (\bar A + \sqrt{\lambda} I)^{-1}

    :math:`G` is the second moment of the per-example output derivative
    :math:`Ds = B g` of a loss averaged over the batch (``batch_averaged=True``; for a summed
    loss, :math:`g` is already per example and :math:`G = \frac1B\sum_r g_r g_r^\top`). Both
    factors keep running averages (:math:`\bar A, \bar G`, decay ``stat_decay``; the first step
    takes its own) whose damped inverses are refreshed every ``update_every`` steps (Cholesky,
    float64). Then the SGD momentum update runs, with torch's kernel. Micro-batches combine
    as their concatenation; under data parallelism both factors combine over the ranks. Under
    FSDP2 the output-side factor mixes the rows of :math:`\tilde G`, so each layer's gradient
    is gathered (one layer at a time: an all-gather of its weight's and bias's gradients) and
    each rank keeps its own rows of the preconditioned gradient.

    Output gradients are captured for the supported layers (``capture_grad_outputs``).
    State per preconditioned weight: ``input_second_moment``, ``input_inverse``,
    ``output_grad_second_moment``, ``output_grad_inverse`` and ``statistics_steps``.

    Args:
        model: The model.
        lr: Learning rate.
        momentum: SGD momentum factor.
        damping: :math:`\lambda`; each factor is damped by :math:`\sqrt\lambda` (>= 0). Without an
            adaptive trust region (KL clipping), small values let the update blow up.
        stat_decay: Decay of the running factors, in [0, 1).
        update_every: Refresh the inverses every this many statistics steps (>= 1).
        statistics_every: Collect statistics every this many steps (>= 1, keyword-only); between
            them the hooks keep nothing and return at once, and the kept inverses precondition.
        max_dim: Leave layers with a factor larger than this to plain SGD (None: no limit).
        distributed_inversion: Under data parallelism, invert each factor on one rank and
            broadcast it (instead of every rank inverting every factor).
        batch_averaged: Whether the loss is a mean over the batch (the inputs' first dimension).
        inverse: ``"cholesky"`` (default) or ``"eigh"``: keep each factor's eigendecomposition,
            so a change of ``damping`` applies at the next step without a new decomposition.
        inverse_dtype: Precision of the decomposition, ``torch.float64`` (default) or ``torch.float32``.
        params: Parameters or param groups of ``model`` (default: all that require grad).
        **sgd_kwargs: Any other ``torch.optim.SGD`` argument and ``storage``.

    References:
        James Martens and Roger Grosse, "Optimizing Neural Networks with Kronecker-factored
        Approximate Curvature", ICML 2015. Roger Grosse and James Martens, "A Kronecker-factored
        approximate Fisher matrix for convolution layers", ICML 2016.
    """

    factors = ("input", "output_grad")
    statistics = KroneckerFactors
    reads_capability = "output_grad_rows"  # layers with both sides (not MultiheadAttention's in_proj)

    def __init__(
        self, model: nn.Module, lr: float | None = None, *args: Any, batch_averaged: bool = True, **kwargs: Any
    ) -> None:
        if not isinstance(batch_averaged, bool):
            raise ValueError(f"Invalid batch_averaged: {batch_averaged!r} (must be True or False)")
        self._batch_averaged = batch_averaged
        super().__init__(model, lr, *args, **kwargs)

    def _check_param_groups(self) -> None:
        super()._check_param_groups()
        self._set_group_defaults(batch_averaged=self._batch_averaged)

    def _local_sums(self, layer: Layer, sums: dict[str, tuple[Tensor, Tensor]]) -> dict[str, tuple[Tensor, Tensor]]:
        # A mean-reduced loss divides each output gradient by this rank's batch B (all its
        # micro-batches together), so Ds = B g. Summing (B^2 sum g g^T) and B over ranks, then
        # dividing, gives G = E[sum over positions of Ds Ds^T] whatever the split.
        grads, batch = sums["output_grad"]
        if layer.group["batch_averaged"]:
            grads = grads * (batch * batch)
        return {**sums, "output_grad": (grads, batch)}

    def _factor_dims(self, layer: Layer) -> tuple[int, ...]:
        return layer.kind.matrix_shape(layer.module, layer.homogeneous)  # both sides

    def _damping(self, group: dict[str, Any], factor: str) -> float:
        return math.sqrt(float(group["damping"]))

    def _precondition(self, layer: Layer, matrix: Tensor, inverses: dict[str, Tensor]) -> Tensor:
        return inverses["output_grad"].to(matrix.dtype) @ matrix @ inverses["input"].to(matrix.dtype)

    def _precondition_rows(self, layer: Layer, matrix: Tensor, inverses: dict[str, Tensor], rows: slice) -> Tensor:
        return inverses["output_grad"][rows].to(matrix.dtype) @ matrix @ inverses["input"].to(matrix.dtype)
