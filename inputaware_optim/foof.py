"""FOOF: one-sided Kronecker preconditioning by the second moment of the layer inputs."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .distributed import all_reduce_sum_
from .inputs import Inputs
from .layers import Layer, bias_of, weight_of
from .sgd import InputAwareSGD

__all__ = ["FOOF"]


class FOOF(InputAwareSGD):
    r"""FOOF (Benzing 2022): gradient descent on neurons, a one-sided Kronecker preconditioner.

    For each ``nn.Linear`` and ``nn.Conv2d`` (``groups=1``, through its unfolded input
    patches), with :math:`\tilde x` the input with a constant 1 appended when the layer's
    bias is trained (the homogeneous coordinate) and :math:`\tilde G` the gradient of the
    weight with the bias gradient as its last column:

    .. math::
        A_t = \frac{1}{N}\sum_{n=1}^{N} \tilde x_n \tilde x_n^\top, \qquad
        \bar A_1 = A_1, \quad \bar A_t = \beta \bar A_{t-1} + (1-\beta) A_t, \qquad
        \tilde G \leftarrow \tilde G\,(\bar A + \lambda I)^{-1}

    where the :math:`N` samples are every row of every call of the step (all leading
    dimensions flattened, so ``k`` micro-batches give the statistics of their concatenation).
    The inverse (Cholesky, in float64) is refreshed every ``update_every`` steps. Then the
    SGD momentum update runs, with torch's kernel; parameters of other modules take it
    directly. Under data parallelism :math:`A_t` is averaged over the data-parallel ranks.

    State per preconditioned weight: ``input_second_moment`` (:math:`\bar A`),
    ``preconditioner`` (the damped inverse) and ``statistics_steps``.

    Args:
        model: The model.
        lr: Learning rate.
        momentum: SGD momentum factor.
        damping: :math:`\lambda`, added to the diagonal before inverting (>= 0).
        stat_decay: :math:`\beta`, the decay of the running second moment, in [0, 1).
        update_every: Refresh the inverse every this many steps (>= 1).
        params: Parameters or param groups of ``model`` (default: all that require grad).
        **sgd_kwargs: Any other ``torch.optim.SGD`` argument (``weight_decay``, ``nesterov``, ...)
            and ``storage``.

    Reference:
        Frederik Benzing, "Gradient Descent on Neurons and its Link to Approximate
        Second-Order Optimization", ICML 2022.
    """

    captured_module_types = (nn.Linear, nn.Conv2d)

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        momentum: float = 0.9,
        damping: float = 1e-3,
        stat_decay: float = 0.95,
        update_every: int = 10,
        *,
        params: Any = None,
        **sgd_kwargs: Any,
    ) -> None:
        _check_kronecker_hyperparameters(damping, stat_decay, update_every)
        super().__init__(model, params, lr=lr, momentum=momentum, **sgd_kwargs)
        self._set_group_defaults(damping=damping, stat_decay=stat_decay, update_every=update_every)
        for group in self.param_groups:
            _check_kronecker_hyperparameters(group["damping"], group["stat_decay"], group["update_every"])
        self._warn_if_no_layers("input_rows", "nn.Linear or nn.Conv2d (groups=1)")

    @torch.no_grad()
    def step(self, closure: Any = None, inputs: Inputs | None = None) -> Any:
        """Precondition the gradients of the supported layers, then take the SGD step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        assert inputs is not None
        layers, moments = self._input_moments(inputs)
        # Every inverse is computed (and may fail) before any gradient changes: no half step.
        updates = [self._refreshed(layer, moment) for layer, moment in zip(layers, moments, strict=True)]
        for layer, (state, moment, preconditioner) in zip(layers, updates, strict=True):
            state["input_second_moment"] = moment
            state["preconditioner"] = preconditioner
            state["statistics_steps"] = state.get("statistics_steps", 0) + 1
            matrix = layer.kind.grad_matrix(layer.module, layer.homogeneous)
            layer.kind.set_grad_matrix(layer.module, matrix @ preconditioner.to(matrix.dtype), layer.homogeneous)
        super().step(inputs=inputs)
        return loss

    def _input_moments(self, inputs: Inputs) -> tuple[list[Layer], list[Tensor]]:
        """This step's :math:`A_t` for every layer with gradients and captured inputs."""
        layers, sums, counts = [], [], []
        for layer in self._layers("input_rows"):
            module, weight, bias = layer.module, weight_of(layer.module), bias_of(layer.module)
            if weight.grad is None or (bias is not None and layer.homogeneous and bias.grad is None):
                continue
            entry = inputs.get(weight)
            if entry is None:  # nothing captured (Inputs warns): plain SGD for this layer
                continue
            rows = layer.kind.input_rows(module, entry, layer.homogeneous)
            layers.append(layer)
            sums.append(rows.T @ rows)
            counts.append(rows.new_tensor(float(rows.shape[0])))
        all_reduce_sum_(sums + counts, self.data_parallel_group)
        return layers, [total / count for total, count in zip(sums, counts, strict=True)]

    def _refreshed(self, layer: Layer, moment: Tensor) -> tuple[dict[str, Any], Tensor, Tensor]:
        state = self.state[weight_of(layer.module)]
        group = layer.group
        if "input_second_moment" in state:
            moment = state["input_second_moment"] * group["stat_decay"] + moment * (1 - group["stat_decay"])
        preconditioner = state.get("preconditioner")
        if preconditioner is None or state.get("statistics_steps", 0) % group["update_every"] == 0:
            preconditioner = damped_inverse(moment, group["damping"], self.capture.name(layer.module))
        return state, moment, preconditioner


def damped_inverse(matrix: Tensor, damping: float, name: str) -> Tensor:
    """:math:`(M + \\lambda I)^{-1}` by Cholesky in float64, returned in ``matrix``'s dtype.

    Raises:
        RuntimeError: If the damped matrix is not positive definite (damping too small).
    """
    damped = matrix.double() + damping * torch.eye(matrix.shape[0], dtype=torch.float64, device=matrix.device)
    factor, info = torch.linalg.cholesky_ex(damped)
    if info.item() != 0:
        raise RuntimeError(
            f"the damped statistics of {name} are not positive definite (damping={damping}); "
            "increase damping. No parameter was changed by this step"
        )
    return torch.cholesky_inverse(factor).to(matrix.dtype)


def _check_kronecker_hyperparameters(damping: float, stat_decay: float, update_every: int) -> None:
    if not damping >= 0.0:
        raise ValueError(f"Invalid damping: {damping} (must be >= 0)")
    if not 0.0 <= stat_decay < 1.0:
        raise ValueError(f"Invalid stat_decay: {stat_decay} (must be in [0, 1))")
    if isinstance(update_every, bool) or not isinstance(update_every, int) or update_every < 1:
        raise ValueError(f"Invalid update_every: {update_every!r} (must be an integer >= 1)")
