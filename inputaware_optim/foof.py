"""FOOF: one-sided Kronecker preconditioning by the second moment of the layer inputs."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .kronecker import KroneckerPreconditioner
from .layers import Layer
from .sgd import SGDWithRule

__all__ = ["FOOF", "FOOFPreconditioner"]


class FOOFPreconditioner(KroneckerPreconditioner):
    r"""FOOF's transform of the gradients: :math:`\tilde G \leftarrow \tilde G\,(\bar A + \lambda I)^{-1}` for
    each layer with input rows (``FOOF``'s docstring has the whole rule). Chain it in front of any stock
    optimizer: ``InputAwareOptimizer(model, rules=[FOOFPreconditioner()], base=torch.optim.AdamW, lr=...)``.

    Args: ``damping``, ``stat_decay``, ``update_every``, ``statistics_every``, ``max_dim``,
    ``distributed_inversion``, ``inverse``, ``inverse_dtype``, as ``FOOF``'s.
    """

    label = "FOOF"
    factors = ("input",)
    acts_on_rows = True

    def _precondition(
        self, layer: Layer, matrix: Tensor, inverses: dict[str, Tensor], rows: slice = slice(None)
    ) -> Tensor:
        dtype = torch.promote_types(matrix.dtype, inverses["input"].dtype)  # (no half-precision product)
        return (matrix.to(dtype) @ inverses["input"].to(dtype))[rows]


class FOOF(SGDWithRule):
    r"""FOOF (Benzing 2022): gradient descent on neurons, a one-sided Kronecker preconditioner.

    For each layer with input rows (``nn.Linear``, Hugging Face's ``Conv1D``, ``nn.Conv1d/2d/3d``
    through their unfolded patches; a grouped convolution one factor per group), with
    :math:`\tilde x` the input with a 1 appended when the bias is trained and :math:`\tilde G` the
    weight gradient with the bias gradient as its last column:

    .. math::
        A_t = \frac{1}{N}\sum_{n=1}^{N} \tilde x_n \tilde x_n^\top, \qquad
        \bar A_1 = A_1, \quad \bar A_t = \beta \bar A_{t-1} + (1-\beta) A_t, \qquad
        \tilde G \leftarrow \tilde G\,(\bar A + \lambda I)^{-1}

    over the :math:`N` rows of every call of the step (micro-batches and data-parallel ranks
    combine as their concatenation), the inverse refreshed every ``update_every`` optimizer
    steps; then the SGD momentum update. Other parameters take plain SGD. Under FSDP2 each rank
    preconditions the rows of :math:`\tilde G` it holds.

    State per preconditioned weight, in ``optimizer.rules[0].state[weight]``: ``input_second_moment``
    (:math:`\bar A`), ``input_inverse`` and ``statistics_steps``; ``optimizer.state`` is SGD's (or the base's).

    Args:
        model: The model.
        lr: Learning rate.
        momentum: SGD momentum (``None``: 0.9; with ``base=``, the base's own default).
        damping: :math:`\lambda` (>= 0), absolute: it scales with the inputs' variance. A step whose
            :math:`\bar A + \lambda I` has a condition number at or above ``inverses.condition_limit`` in its
            dtypes (8.4e5 for float32 statistics: beyond, the step would be rounding) is refused, changing
            nothing, by either ``inverse``.
        stat_decay: :math:`\beta`, in [0, 1).
        update_every: Refresh the inverse every this many optimizer steps (>= 1).
        statistics_every: Collect statistics every this many steps (>= 1); the kept inverses between.
        max_dim: Leave layers with a larger factor to plain SGD (None: no limit).
        distributed_inversion: Under data parallelism, invert each factor on one rank and broadcast it.
        inverse: ``"cholesky"`` (default) or ``"eigh"`` (keeps each eigendecomposition, so a change
            of ``damping`` applies at the next step without a new one).
        inverse_dtype: Precision of the decomposition, ``torch.float64`` (default) or ``torch.float32``.
        params: Parameters or param groups of ``model`` (default: all that require grad).
        **sgd_kwargs: Any other ``torch.optim.SGD`` argument, ``storage``, or ``base=`` (a stock
            optimizer class to take the update instead of SGD) and its arguments.

    Reference:
        Frederik Benzing, "Gradient Descent on Neurons and its Link to Approximate
        Second-Order Optimization", ICML 2022.
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
        max_dim: int | None = None,
        distributed_inversion: bool = False,
        inverse: str = "cholesky",
        inverse_dtype: torch.dtype = torch.float64,
        params: Any = None,
        **sgd_kwargs: Any,
    ) -> None:
        rule = FOOFPreconditioner(
            damping,
            stat_decay,
            update_every,
            statistics_every=statistics_every,
            max_dim=max_dim,
            distributed_inversion=distributed_inversion,
            inverse=inverse,
            inverse_dtype=inverse_dtype,
        )
        self._construct(model, lr, momentum, rule, params, sgd_kwargs)
