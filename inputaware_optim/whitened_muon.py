r"""WhitenedMuon: Muon's steepest descent in the metric of the layer's whitened inputs.

For a layer with input rows, Muon's update is the polar factor of the (momentum of the) gradient: the steepest
descent under the spectral norm of the weight change. WhitenedMuon takes it under the spectral norm of the change
of the layer's output on whitened inputs, :math:`\|\Delta\tilde W A^{1/2}\|_2` with :math:`A` the inputs' damped
second moment, which gives :math:`\Delta\tilde W \propto \operatorname{polar}(U A^{-1/2})\,A^{-1/2}`.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import Tensor, nn

from .capture import unwrap_model
from .distributed import gathered_rows, local_matrix_rows, row_range, set_local_matrix_rows, sharded
from .kronecker import KroneckerPreconditioner
from .layers import Layer, LayerKind, LinearKind, bias_of, weight_of
from .sgd import SGDWithRule

__all__ = ["POLARS", "WhitenedMuon", "WhitenedMuonPreconditioner", "muon_rms_scale", "newton_schulz", "polar"]

_MUON = inspect.signature(torch.optim.Muon).parameters  # torch's own defaults, so they stay in step
NS_COEFFICIENTS: tuple[float, float, float] = _MUON["ns_coefficients"].default
NS_STEPS: int = _MUON["ns_steps"].default
NS_EPS: float = _MUON["eps"].default
POLARS = ("newton-schulz", "svd")  # how the polar factor is taken


def newton_schulz(matrix: Tensor) -> Tensor:
    """Muon's approximation of the orthogonal polar factor of ``matrix`` (``U Vᵀ`` of its thin SVD): the quintic
    Newton–Schulz iteration of ``torch.optim.Muon`` (its coefficients, steps and eps), in ``matrix``'s dtype. Its
    singular values land in about [0.7, 1.2] rather than on 1, as Muon's do."""
    a, b, c = NS_COEFFICIENTS
    tall = matrix.shape[-2] > matrix.shape[-1]
    x = matrix.mT if tall else matrix
    x = x / x.norm().clamp(min=NS_EPS)
    for _ in range(NS_STEPS):
        gram = x @ x.mT
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def polar(matrix: Tensor, method: str = "newton-schulz") -> Tensor:
    """The orthogonal polar factor of ``matrix``: ``"svd"`` exactly, ``"newton-schulz"`` as Muon approximates it."""
    if method == "svd":
        u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
        return u @ vh
    return newton_schulz(matrix)


class WhitenedMuonPreconditioner(KroneckerPreconditioner):
    r"""WhitenedMuon's transform of the gradients (``WhitenedMuon``'s docstring has the whole rule): each layer's
    gradient matrix is replaced by Muon's step in the input-whitened metric, momentum and scaling included, so the
    base must add neither: chain it in front of ``torch.optim.SGD`` without momentum,
    ``InputAwareOptimizer(model, params=..., rules=[WhitenedMuonPreconditioner()], base=torch.optim.SGD, lr=...)``.
    Every parameter it is given must be a weight (or bias) of a layer it whitens: another would take the base's
    plain step, and is refused by name.

    Args: ``damping``, ``stat_decay``, ``update_every``, ``statistics_every``, ``momentum``, ``nesterov``,
    ``polar``, ``distributed_inversion``, ``inverse_dtype``, as ``WhitenedMuon``'s (``momentum`` and ``nesterov``
    are kept in the param groups as ``muon_momentum`` and ``muon_nesterov``: ``momentum`` there is SGD's).
    """

    label = "WhitenedMuon"
    factors = ("input",)
    acts_on_rows = False  # the polar factor couples every row: under FSDP2 the rows are gathered
    power = -0.5
    kept_as = "inverse_root"
    _tensor_parallel_advice = (
        "Keep the layers WhitenedMuon trains out of tensor parallelism (FSDP2 or DDP alone), or train them with NLMS"
    )

    def __init__(
        self,
        damping: float = 0.1,
        stat_decay: float = 0.95,
        update_every: int = 10,
        *,
        statistics_every: int = 1,
        momentum: float = 0.95,
        nesterov: bool = True,
        polar: str = "newton-schulz",
        distributed_inversion: bool = False,
        inverse_dtype: torch.dtype = torch.float64,
    ) -> None:
        if polar not in POLARS:
            raise ValueError(f"Invalid polar: {polar!r} (must be one of {', '.join(map(repr, POLARS))})")
        self._polar = polar
        self.defaults = {"muon_momentum": momentum, "muon_nesterov": nesterov}  # (kept by the base's __init__)
        super().__init__(
            damping,
            stat_decay,
            update_every,
            statistics_every=statistics_every,
            distributed_inversion=distributed_inversion,
            inverse="eigh",
            inverse_dtype=inverse_dtype,
        )

    def check_group(self, group: dict[str, Any]) -> None:
        super().check_group(group)
        if not 0.0 <= group["muon_momentum"] < 1.0:
            raise ValueError(f"Invalid momentum: {group['muon_momentum']} (must be in [0, 1); muon_momentum in groups)")
        if not isinstance(group["muon_nesterov"], bool):
            raise ValueError(f"Invalid nesterov: {group['muon_nesterov']!r} (must be True or False)")
        if group.get("momentum", 0) != 0:
            raise ValueError(
                f"WhitenedMuon hands its base the whole update, Muon's momentum included: a base momentum of "
                f"{group['momentum']} would apply momentum a second time. Use torch.optim.SGD with momentum=0 (set "
                "WhitenedMuon's own with momentum=, kept in the param groups as muon_momentum)"
            )

    def excluded(self, layer: Layer) -> str | None:
        blocks = layer.kind.blocks(layer.module)
        if blocks > 1:
            return f"its weight is {blocks} independent blocks (WhitenedMuon takes one polar factor per layer)"
        return super().excluded(layer)

    def setup(self, optimizer: Any) -> None:
        super().setup(optimizer)
        whitened = set()
        for layer in self._layers():
            whitened.add(id(weight_of(layer.module)))
            if layer.homogeneous:
                whitened.add(id(bias_of(layer.module)))
        others = [p for p in optimizer._params() if id(p) not in whitened]
        if others:
            names = {id(p): name for name, p in unwrap_model(optimizer.model).named_parameters()}
            listed = ", ".join(names.get(id(p), f"a tensor of shape {tuple(p.shape)}") for p in others[:4])
            more = f" and {len(others) - 4} more" if len(others) > 4 else ""
            raise ValueError(
                f"WhitenedMuon updates the weights (and biases) of layers with input rows (nn.Linear, nn.Conv1d/2d/3d "
                f"with groups=1, ...); it was given {listed}{more}, which it does not whiten and which would take "
                "plain SGD's step. Give those to another optimizer, as Muon's recipe gives AdamW the embeddings, norms "
                "and biases (docs/rules/whitened-muon.md shows it)"
            )

    def _tensor_parallel_problem(self, style: str, module: nn.Module, kind: LayerKind) -> str | None:
        if style == "columns" and type(kind) is LinearKind:
            return (
                "ColwiseParallel splits its output features over the ranks, and the polar factor couples them all; "
                "gathering the gradient over the tensor-parallel ranks is not implemented"
            )
        return super()._tensor_parallel_problem(style, module, kind)

    def _set_preconditioned(self, layer: Layer, inverses: dict[str, Tensor]) -> None:
        """Muon's momentum of this rank's rows of ``G̃``, then the whitened polar step of the whole direction (under
        FSDP2, gathered from every rank's rows) written into this rank's rows of the gradients."""
        module, kind, homogeneous, group = layer.module, layer.kind, layer.homogeneous, layer.group
        weight, bias = weight_of(module), bias_of(module)
        split = sharded(weight)
        gradient = local_matrix_rows(weight, bias, homogeneous) if split else kind.grad_matrix(module, homogeneous)
        dtype = torch.promote_types(gradient.dtype, torch.float32)  # (momentum and polar step in float32 at least)
        state = self.state[weight]
        previous, raw, mu = state.get("momentum_buffer"), gradient.to(dtype), group["muon_momentum"]
        buffer = (torch.zeros_like(raw) if previous is None else previous.to(dtype)).lerp(raw, 1 - mu)
        direction = raw.lerp(buffer, mu) if group["muon_nesterov"] else buffer
        whole = gathered_rows(direction, weight) if split else direction
        root = inverses["input"].to(dtype)
        step = polar(whole @ root, self._polar) @ root * muon_rms_scale(whole.shape)
        if split:
            set_local_matrix_rows(weight, bias, step[row_range(weight)].to(gradient.dtype), homogeneous)
        else:
            kind.set_grad_matrix(module, step.to(gradient.dtype), homogeneous)
        state["momentum_buffer"] = buffer


def muon_rms_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """``0.2 · sqrt(max(rows, columns))``: Muon's ``adjust_lr_fn="match_rms_adamw"``, which gives an orthogonal
    update the entries' RMS of AdamW's (about 0.2), so that one learning rate serves both."""
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


class WhitenedMuon(SGDWithRule):
    r"""Muon in the input-whitened metric: steepest descent under the spectral norm of the layer's output change
    on whitened inputs.

    For each layer with input rows (``nn.Linear``, Hugging Face's ``Conv1D``, ``nn.Conv1d/2d/3d`` with
    ``groups=1`` through their unfolded patches), with :math:`\tilde x` its input rows (a 1 appended when the bias
    is trained), :math:`\tilde G` its weight gradient (the bias gradient as its last column), FOOF's running
    second moment :math:`\bar A` of :math:`\tilde x\tilde x^\top` and :math:`A_\lambda = \bar A + \lambda I`:

    .. math::
        M_t = \mu M_{t-1} + (1-\mu)\tilde G_t, \qquad U_t = (1-\mu)\tilde G_t + \mu M_t
        \ \ (\text{Nesterov; else } U_t = M_t),

        \tilde W \leftarrow (1 - \eta\,\mathrm{wd})\,\tilde W
            - \eta\; 0.2\sqrt{\max(m, n)}\;\operatorname{polar}(U_t A_\lambda^{-1/2})\,A_\lambda^{-1/2}

    (:math:`m \times n` the shape of :math:`\tilde G`, :math:`\operatorname{polar}(X) = UV^\top` of the thin SVD
    :math:`X = U\Sigma V^\top`). With :math:`A_\lambda = I` it is ``torch.optim.Muon`` with
    ``adjust_lr_fn="match_rms_adamw"`` (so a learning rate of AdamW's order serves). The momentum sits where
    Muon's does, on the raw gradient, before the polar step (which is not linear); a refresh of
    :math:`A_\lambda` changes the metric, not the history. :math:`A_\lambda^{-1/2}` comes from
    ``torch.linalg.eigh`` in ``inverse_dtype``, refreshed every ``update_every`` steps on the statistics steps
    (every ``statistics_every``), and a step whose :math:`A_\lambda` has a condition number at or above
    ``inverses.condition_limit`` is refused before any change. The update is SGD's (no momentum: the rule's is
    Muon's) with its coupled weight decay, which on this direction is Muon's decoupled one.

    Every parameter must belong to a layer it whitens: give embeddings, norms and other parameters to another
    optimizer (AdamW, as in Muon's recipe; docs/rules/whitened-muon.md). Under DDP the statistics are summed over
    the ranks; under FSDP2 each rank keeps the momentum of its rows and the polar step is taken on the gathered
    matrix; tensor-parallel layers are refused.

    State per weight, in ``optimizer.rules[0].state[weight]``: ``momentum_buffer`` (:math:`M`, in float32 at
    least), ``input_second_moment`` (:math:`\bar A`), ``input_eigenvalues``, ``input_eigenvectors``,
    ``input_inverse_root`` (:math:`A_\lambda^{-1/2}`), ``input_inverse_damping``, ``statistics_steps``,
    ``inverse_step``. In the param groups: ``muon_momentum``, ``muon_nesterov`` and the Kronecker
    hyperparameters beside SGD's.

    Args:
        model: The model.
        lr: Learning rate (of AdamW's order: the update's RMS is about 0.2, as AdamW's).
        weight_decay: Decoupled weight decay (0.1, ``torch.optim.Muon``'s default).
        momentum: :math:`\mu`, Muon's momentum (0.95).
        nesterov: Muon's Nesterov form (True).
        damping: :math:`\lambda` (>= 0), absolute, as FOOF's.
        stat_decay: Decay of the running second moment, in [0, 1).
        update_every: Refresh the inverse root every this many optimizer steps (>= 1).
        statistics_every: Collect statistics every this many steps (>= 1).
        polar: ``"newton-schulz"`` (Muon's 5 quintic steps, in float32 at least) or ``"svd"`` (exact).
        distributed_inversion: Under data parallelism, decompose each factor on one rank and broadcast it.
        inverse_dtype: Precision of the eigendecomposition, ``torch.float64`` (default) or ``torch.float32``.
        params: Parameters or param groups of ``model`` (default: all that require grad; each must belong to a
            layer WhitenedMuon whitens).
        **kwargs: ``InputAwareOptimizer``'s arguments (``storage``, ``strict``, ``process_group``, ...).

    References:
        Keller Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024; Jeremy Bernstein and
        Laker Newhouse, "Old Optimizer, New Norm: An Anthology", 2024 (steepest descent under a layer's operator
        norm); Frederik Benzing, "Gradient Descent on Neurons", ICML 2022 (the input factor).
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float | None = None,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        damping: float = 0.1,
        stat_decay: float = 0.95,
        update_every: int = 10,
        *,
        statistics_every: int = 1,
        polar: str = "newton-schulz",
        distributed_inversion: bool = False,
        inverse_dtype: torch.dtype = torch.float64,
        params: Any = None,
        **kwargs: Any,
    ) -> None:
        if "base" in kwargs:
            raise TypeError(
                "WhitenedMuon takes no base=: its update is SGD's without momentum (chain "
                "WhitenedMuonPreconditioner in an InputAwareOptimizer to choose another)"
            )
        rule = WhitenedMuonPreconditioner(
            damping,
            stat_decay,
            update_every,
            statistics_every=statistics_every,
            momentum=momentum,
            nesterov=nesterov,
            polar=polar,
            distributed_inversion=distributed_inversion,
            inverse_dtype=inverse_dtype,
        )
        kwargs["weight_decay"] = weight_decay
        self._construct(model, lr, None, rule, params, kwargs, default_momentum=None)
