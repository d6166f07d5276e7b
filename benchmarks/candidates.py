r"""Candidate input-aware rules (issue 44), each a transform on the public ``Rule`` API in front of a stock optimizer.

The third, Muon's steepest descent in the input-whitened metric, met the shipping bar and is
``inputaware_optim.WhitenedMuon``; these two stay out of the public package (docs/rules/candidates.md has
their formulas, their papers, where they differ and what they measured):

- ``TwoSidedMuon``: WhitenedMuon's two-sided form with K-FAC's output-gradient factor,
  :math:`\Delta\tilde W = \hat B_\lambda^{-1/2}\operatorname{polar}(\hat B_\lambda^{-1/2} M A_\lambda^{-1/2})\,
  A_\lambda^{-1/2}`.
- ``EigenbasisAdam``: Adam's moments in the eigenbases of the two Kronecker factors (SOAP's idea on K-FAC's
  factors, EKFAC's basis).

Each hands its base the whole update direction (momentum included, scaled as its recipe scales it), so
the base is ``torch.optim.SGD`` without momentum: SGD's step ``p ← p − lr (g + wd p)`` is then exactly Muon's
and AdamW's decoupled step ``p ← (1 − lr wd) p − lr g``. A base that adds momentum is refused.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from inputaware_optim import Call, Captured, Inputs, Layer, Reduction, Rule
from inputaware_optim.coverage import layer_treatment
from inputaware_optim.inverses import Check, eigenbasis, eigenvalue_condition, refuse_any
from inputaware_optim.kronecker import FactorSums
from inputaware_optim.layers import bias_of, weight_of
from inputaware_optim.whitened_muon import POLARS, muon_rms_scale, polar

__all__ = [
    "EigenbasisAdam",
    "KroneckerSums",
    "TwoSidedMuon",
]


class KroneckerSums(FactorSums):
    """FOOF's input sums (``kronecker.FactorSums``: ``x̃ᵀx̃`` over the call's input rows and their number, kept
    under the weight), and once the call's output gradients arrive ``gᵀg`` over its output-gradient rows."""

    grad_outputs = True

    def backward(self, call: Call, kept: Any) -> Any:
        grads = self.layers[call.module].kind.output_grad_rows(call.module, Captured([call]))
        return {**kept, "output_grad": (grads.mT @ grads, float(grads.shape[-2]))}


class _Plan:
    """One layer's step, computed in full before any state or gradient changes."""

    __slots__ = ("layer", "moments", "refreshed", "state", "transform")

    def __init__(self, layer: Layer, state: dict[str, Any]) -> None:
        self.layer, self.state = layer, state
        self.moments: dict[str, Tensor] = {}
        self.transform: dict[str, Tensor] = {}
        self.refreshed = False


class _KroneckerCandidate(Rule):
    """What the candidates share: the factors' running moments on FOOF's and K-FAC's schedule, refreshed
    transforms checked against the inverse contract before any change, and the gradient matrix replaced.

    Subclasses set ``factors`` (and ``layers``, the registry capability they need), compute a refreshed
    transform from the running moments (``_refresh``, returning the ``Check`` of what it inverts) and the new
    gradient matrix with the state it leaves (``_direction``)."""

    layers: ClassVar[str | None] = "input_rows"
    factors: ClassVar[tuple[str, ...]] = ("input",)
    transform_keys: ClassVar[tuple[str, ...]] = ()
    what: ClassVar[str] = ""

    def __init__(
        self,
        stat_decay: float,
        update_every: int,
        statistics_every: int,
        inverse_dtype: torch.dtype,
        own: dict[str, Any],
    ) -> None:
        if inverse_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"Invalid inverse_dtype: {inverse_dtype!r} (must be torch.float64 or torch.float32)")
        self._inverse_dtype = inverse_dtype
        self.defaults = {
            "stat_decay": stat_decay,
            "update_every": update_every,
            "statistics_every": statistics_every,
            **own,
        }
        self.check_group(self.defaults)
        self._sums: FactorSums | None = None
        self._armed = True
        self._steps = 0  # optimizer steps taken: the schedule counts them

    @property
    def reads(self) -> list[Reduction]:  # type: ignore[override]
        """The factor sums, on the steps that collect statistics only (between, the hooks keep nothing)."""
        return [self._sums] if self._sums is not None and self._armed else []

    def check_group(self, group: dict[str, Any]) -> None:
        if not 0.0 <= group["stat_decay"] < 1.0:
            raise ValueError(f"Invalid stat_decay: {group['stat_decay']} (must be in [0, 1))")
        for name in ("update_every", "statistics_every"):
            value = group[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Invalid {name}: {value!r} (must be an integer >= 1)")
        if group.get("momentum", 0) != 0:
            raise ValueError(
                f"{type(self).__name__} hands its base the whole update, its own momentum included: a base momentum "
                f"of {group['momentum']} would apply momentum a second time. Use torch.optim.SGD with momentum=0"
            )

    def setup(self, optimizer: Any) -> None:
        if optimizer.data_parallel_group is not None:
            raise NotImplementedError(
                f"{type(self).__name__} is a candidate rule and runs in one process: its statistics are not summed "
                "over data-parallel ranks. Use FOOF or K-FAC under DDP and FSDP2"
            )
        sums = KroneckerSums if "output_grad" in self.factors else FactorSums
        self._sums = sums(self._layers(optimizer))
        self._armed = self._due(optimizer)

    def _due(self, optimizer: Any) -> bool:
        return any(self._steps % group["statistics_every"] == 0 for group in optimizer.param_groups)

    def _layers(self, optimizer: Any) -> list[Layer]:
        assert self.layers is not None
        return [layer for layer in optimizer.layers(self.layers) if self.excluded(layer) is None]

    def excluded(self, layer: Layer) -> str | None:
        """Why the rule leaves ``layer`` to the base's own update, or ``None``."""
        blocks = layer.kind.blocks(layer.module)
        if blocks > 1:
            return f"its weight is {blocks} independent blocks (a candidate takes one polar factor or basis per layer)"
        return None

    def treatment(self, optimizer: Any, param: Tensor, module: nn.Module | None) -> tuple[str, str | None, bool]:
        assert self.layers is not None
        return layer_treatment(
            optimizer, param, module, self.layers, f"{type(self).__name__}: {self.what}", self.excluded
        )

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self._steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._steps = int(state.get("steps", 0))
        self._armed = self._due(self.optimizer)

    def advance(self, optimizer: Any) -> None:
        self._steps += 1
        self._armed = self._due(optimizer)  # read by the next forward

    def update(self, optimizer: Any, inputs: Inputs) -> None:
        """Replace each covered layer's gradient matrix by the candidate's update direction."""
        # (not armed for this step's forward: statistics_every changed since)
        armed = self._sums is not None and self._sums in optimizer.capture.reductions
        totals = inputs.reduced(self._sums) if armed and self._sums is not None else {}
        plans = [plan for layer in self._layers(optimizer) if (plan := self._plan(layer, totals, armed, inputs))]
        checks = [check for plan in plans if plan.refreshed and (check := self._refresh(plan)) is not None]
        refuse_any(checks)  # every refreshed transform, before any change: a refused step changes nothing
        steps = []
        for plan in plans:
            matrix = plan.layer.kind.grad_matrix(plan.layer.module, plan.layer.homogeneous)
            direction, kept = self._direction(plan, matrix.to(torch.promote_types(matrix.dtype, torch.float32)))
            steps.append((plan, direction.to(matrix.dtype), kept))
        for plan, direction, kept in steps:
            state = self.state[weight_of(plan.layer.module)]
            state.update({**kept, **plan.transform})
            if plan.moments:
                state.update({f"{f}_second_moment": m for f, m in plan.moments.items()})
                state["statistics_steps"] = state.get("statistics_steps", 0) + 1
            if plan.refreshed:
                state["refresh_step"] = self._steps
            plan.layer.kind.set_grad_matrix(plan.layer.module, direction, plan.layer.homogeneous)

    def _plan(self, layer: Layer, totals: dict[Tensor, Any], armed: bool, inputs: Inputs) -> _Plan | None:
        """The layer's step: its new running moments on a statistics step, whether its transform is refreshed; or
        ``None`` where it takes the base's plain step (no gradient, or no statistics yet)."""
        weight, bias = weight_of(layer.module), bias_of(layer.module)
        if weight.grad is None or weight.numel() == 0 or (layer.homogeneous and bias is not None and bias.grad is None):
            return None
        group = layer.group
        plan = _Plan(layer, self.state.get(weight, {}))
        if armed and self._steps % group["statistics_every"] == 0:
            sums = totals.get(weight)
            if sums is None:
                inputs.uncaptured(weight)  # (warned: a gradient no captured call explains)
            elif all(sums[factor][1] > 0 for factor in self.factors):  # (a call of no rows: nothing to average)
                for factor in self.factors:
                    numerator, count = sums[factor]
                    previous = plan.state.get(f"{factor}_second_moment")
                    plan.moments[factor] = _running_average(previous, numerator / count, group["stat_decay"])
                since = self._steps - plan.state.get("refresh_step", -math.inf)
                plan.refreshed = since >= group["update_every"] or not self._kept(plan.state)
        if not plan.refreshed:
            if not self._kept(plan.state):
                return None  # (no statistics yet: the base's own step)
            plan.transform = {key: plan.state[key] for key in self.transform_keys}
        return plan

    def _kept(self, state: dict[str, Any]) -> bool:
        return all(key in state for key in self.transform_keys)

    def _name(self, layer: Layer, factor: str) -> str:
        return f"{self.optimizer.capture.name(layer.module)} ({factor})"

    def _refresh(self, plan: _Plan) -> Check | None:
        """Fill ``plan.transform`` from ``plan.moments``; return what to check before any change."""
        raise NotImplementedError

    def _direction(self, plan: _Plan, matrix: Tensor) -> tuple[Tensor, dict[str, Any]]:
        """The update direction handed to the base, and the per-layer state it leaves (both out of place)."""
        raise NotImplementedError


def _running_average(previous: Tensor | None, moment: Tensor, decay: float) -> Tensor:
    """``decay · previous + (1 − decay) · moment`` (no ``previous``: ``moment``), in ``moment``'s dtype."""
    return moment if previous is None else torch.lerp(previous.to(moment.dtype), moment, 1 - decay)


def _inverse_root(values: Tensor, vectors: Tensor, damping: float | Tensor, dtype: torch.dtype) -> Tensor:
    """``Q diag((μ + damping)^(-1/2)) Qᵀ`` in ``dtype``."""
    shifted = values + torch.as_tensor(damping, dtype=values.dtype, device=values.device)
    return ((vectors * shifted.rsqrt().unsqueeze(-2)) @ vectors.mT).to(dtype)


def _decomposed(moment: Tensor, name: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The eigenvalues (those below 0, rounding, as 0) and eigenvectors of ``moment`` in ``dtype``, its statistics
    refused by name if not finite (``inverses.eigenbasis``)."""
    packed = eigenbasis(moment, name, dtype)
    return packed[..., -1, :], packed[..., :-1, :]


class TwoSidedMuon(_KroneckerCandidate):
    r"""``inputaware_optim.WhitenedMuon``'s two-sided form: steepest descent under the spectral norm of
    :math:`\hat B^{1/2}\,\Delta\tilde W\,A^{1/2}`, with K-FAC's output-gradient factor.

    With :math:`\bar B` the running second moment of the output-gradient rows :math:`g g^\top` (K-FAC's
    :math:`G` factor, up to a scale), :math:`\hat B = \bar B / m_B` normalized to mean eigenvalue 1
    (:math:`m_B = \operatorname{tr}\bar B / m`; the polar factor is blind to scale, and so the step is blind to
    the loss's, as Muon's is), and K-FAC's factored damping of :math:`\hat B \otimes \bar A + \lambda I`:
    :math:`A_\lambda = \bar A + \pi\sqrt\lambda I`, :math:`\hat B_\lambda = \hat B + \tfrac{\sqrt\lambda}{\pi} I`,
    :math:`\pi = \sqrt{m_A / m_{\hat B}}` (1 where a factor is zero):

    .. math::
        \tilde G \leftarrow 0.2\sqrt{\max(m, n)}\;\hat B_\lambda^{-1/2}\,
            \operatorname{polar}(\hat B_\lambda^{-1/2}\, U_t\, A_\lambda^{-1/2})\,A_\lambda^{-1/2}

    with :math:`U_t` Muon's momentum of :math:`\tilde G` (on the raw gradient, before the polar step, as in
    ``WhitenedMuon``). A refresh is refused (nothing
    changed) where the product of the damped factors' condition numbers reaches ``inverses.condition_limit``.
    With :math:`\hat B = I` it is ``WhitenedMuon`` with damping split as K-FAC splits it.

    State per weight (``rule.state[weight]``): ``momentum_buffer`` (:math:`M`), ``input_second_moment``,
    ``output_grad_second_moment`` (:math:`\bar B`, unnormalized), ``input_inverse_root``,
    ``output_grad_inverse_root`` (:math:`\hat B_\lambda^{-1/2}`), ``statistics_steps``, ``refresh_step``.

    Args:
        damping: :math:`\lambda` (>= 0), absolute, split as K-FAC's.
        stat_decay: Decay of the running second moments, in [0, 1).
        update_every: Refresh the inverse roots every this many optimizer steps (>= 1).
        statistics_every: Collect statistics every this many steps (>= 1).
        muon_momentum: :math:`\mu`, Muon's momentum (0.95).
        muon_nesterov: Muon's Nesterov form (True).
        polar: ``"newton-schulz"`` (Muon's 5 steps in the gradient's dtype, float32 at least) or ``"svd"`` (exact).
        inverse_dtype: Precision of the eigendecompositions, ``torch.float64`` (default) or ``torch.float32``.

    References:
        As ``WhitenedMuon``; James Martens and Roger Grosse, "Optimizing Neural Networks with Kronecker-factored
        Approximate Curvature", ICML 2015 (the output-gradient factor and the factored damping).
    """

    layers: ClassVar[str | None] = "output_grad_rows"
    factors: ClassVar[tuple[str, ...]] = ("input", "output_grad")
    transform_keys: ClassVar[tuple[str, ...]] = ("input_inverse_root", "output_grad_inverse_root")
    what: ClassVar[str] = "polar step, two-sided Kronecker-whitened"

    def __init__(
        self,
        damping: float = 0.1,
        stat_decay: float = 0.95,
        update_every: int = 10,
        *,
        statistics_every: int = 1,
        muon_momentum: float = 0.95,
        muon_nesterov: bool = True,
        polar: str = "newton-schulz",
        inverse_dtype: torch.dtype = torch.float64,
    ) -> None:
        if polar not in POLARS:
            raise ValueError(f"Invalid polar: {polar!r} (must be one of {', '.join(map(repr, POLARS))})")
        self._polar = polar
        own = {"damping": damping, "muon_momentum": muon_momentum, "muon_nesterov": muon_nesterov}
        super().__init__(stat_decay, update_every, statistics_every, inverse_dtype, own)

    def check_group(self, group: dict[str, Any]) -> None:
        super().check_group(group)
        if not 0.0 <= group["damping"] < math.inf:
            raise ValueError(f"Invalid damping: {group['damping']} (must be finite and >= 0)")
        if not 0.0 <= group["muon_momentum"] < 1.0:
            raise ValueError(f"Invalid muon_momentum: {group['muon_momentum']} (must be in [0, 1))")
        if not isinstance(group["muon_nesterov"], bool):
            raise ValueError(f"Invalid muon_nesterov: {group['muon_nesterov']!r} (must be True or False)")

    def _momentum(self, plan: _Plan, matrix: Tensor) -> tuple[Tensor, Tensor]:
        """Muon's momentum of the raw gradient matrix: the new buffer and the direction taken (Nesterov's or it)."""
        group = plan.layer.group
        previous = plan.state.get("momentum_buffer")
        buffer = torch.zeros_like(matrix) if previous is None else previous.to(matrix.dtype)
        buffer = buffer.lerp(matrix, 1 - group["muon_momentum"])
        return buffer, matrix.lerp(buffer, group["muon_momentum"]) if group["muon_nesterov"] else buffer

    def _refresh(self, plan: _Plan) -> Check | None:
        damping = float(plan.layer.group["damping"])
        a, b = plan.moments["input"], plan.moments["output_grad"]
        names = {f: self._name(plan.layer, f) for f in self.factors}
        values_a, vectors_a = _decomposed(a, names["input"], self._inverse_dtype)
        values_b, vectors_b = _decomposed(b, names["output_grad"], self._inverse_dtype)
        mean_b = values_b.mean()
        values_b = torch.where(mean_b > 0, values_b / mean_b, values_b)  # B̂ = B̄ / m_B
        mean_a, mean_b_hat = values_a.mean(), values_b.mean()
        pi = torch.where((mean_a > 0) & (mean_b_hat > 0), (mean_a / mean_b_hat).sqrt(), 1.0)
        damping_a, damping_b = pi * math.sqrt(damping), math.sqrt(damping) / pi
        plan.transform = {
            "input_inverse_root": _inverse_root(values_a, vectors_a, damping_a, a.dtype),
            "output_grad_inverse_root": _inverse_root(values_b, vectors_b, damping_b, b.dtype),
        }
        conditions = eigenvalue_condition(values_a + damping_a) * eigenvalue_condition(values_b + damping_b)
        name = f"{self.optimizer.capture.name(plan.layer.module)} (output_grad ⊗ input)"
        return Check(conditions, None, (a.dtype, self._inverse_dtype), name, damping, [a, b])

    def _direction(self, plan: _Plan, matrix: Tensor) -> tuple[Tensor, dict[str, Any]]:
        buffer, direction = self._momentum(plan, matrix)
        left = plan.transform["output_grad_inverse_root"].to(matrix.dtype)
        right = plan.transform["input_inverse_root"].to(matrix.dtype)
        step = left @ polar(left @ direction @ right, self._polar) @ right
        return step * muon_rms_scale(matrix.shape), {"momentum_buffer": buffer}


class EigenbasisAdam(_KroneckerCandidate):
    r"""Adam in the eigenbasis of the Kronecker factors: SOAP's idea on K-FAC's factors (EKFAC's basis).

    For each layer with input and output-gradient rows, with :math:`Q_A` and :math:`Q_B` the eigenvectors of the
    running second moments :math:`\bar A` (input rows :math:`\tilde x`) and :math:`\bar B` (output-gradient rows),
    refreshed every ``update_every`` steps on the statistics steps (every ``statistics_every``):

    .. math::
        G' = Q_B^\top \tilde G Q_A, \quad m_t = \beta_1 m_{t-1} + (1-\beta_1) G', \quad
        v_t = \beta_2 v_{t-1} + (1-\beta_2) G'^{\odot 2}, \quad
        \tilde G \leftarrow Q_B\,\frac{m_t / (1-\beta_1^t)}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon}\,Q_A^\top

    The first moment is the momentum of :math:`\tilde G` (SOAP keeps it in the original coordinates; here it is
    kept rotated, and rotated to the new bases at a refresh, which is the same); the second moment stays in place at
    a refresh (matched by eigenvalue rank, as SOAP's). Nothing is inverted, so there is no damping: :math:`\epsilon`
    is Adam's. Non-finite statistics are refused by name (nothing changed). Put it in front of ``torch.optim.SGD``
    without momentum: its step :math:`W \leftarrow (1 - \eta\,\mathrm{wd})W - \eta\tilde G` is then AdamW's.

    State per weight: ``exp_avg`` (:math:`m`, in the current eigenbasis), ``exp_avg_sq`` (:math:`v`), ``step``,
    ``input_second_moment``, ``output_grad_second_moment``, ``input_eigenvectors``, ``output_grad_eigenvectors``,
    ``statistics_steps``, ``refresh_step``.

    Args:
        stat_decay: Decay of the running factors, in [0, 1).
        update_every: Refresh the eigenbases every this many optimizer steps (>= 1).
        statistics_every: Collect statistics every this many steps (>= 1).
        adam_betas: Adam's :math:`(\beta_1, \beta_2)`, torch's defaults (0.9, 0.999).
        adam_eps: Adam's :math:`\epsilon` (1e-8).
        inverse_dtype: Precision of the eigendecompositions, ``torch.float64`` (default) or ``torch.float32``.

    References:
        Nikhil Vyas et al., "SOAP: Improving and Stabilizing Shampoo using Adam", ICLR 2025; Thomas George et al.,
        "Fast Approximate Natural Gradient Descent in a Kronecker-factored Eigenbasis", NeurIPS 2018 (EKFAC).
    """

    layers: ClassVar[str | None] = "output_grad_rows"
    factors: ClassVar[tuple[str, ...]] = ("input", "output_grad")
    transform_keys: ClassVar[tuple[str, ...]] = ("input_eigenvectors", "output_grad_eigenvectors")
    what: ClassVar[str] = "Adam in the Kronecker eigenbasis"

    def __init__(
        self,
        stat_decay: float = 0.95,
        update_every: int = 10,
        *,
        statistics_every: int = 1,
        adam_betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        inverse_dtype: torch.dtype = torch.float64,
    ) -> None:
        own = {"adam_betas": tuple(adam_betas), "adam_eps": adam_eps}
        super().__init__(stat_decay, update_every, statistics_every, inverse_dtype, own)

    def check_group(self, group: dict[str, Any]) -> None:
        super().check_group(group)
        betas = group["adam_betas"]
        if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Invalid adam_betas: {betas!r} (must be two numbers in [0, 1))")
        if not 0.0 <= group["adam_eps"] < math.inf:
            raise ValueError(f"Invalid adam_eps: {group['adam_eps']} (must be finite and >= 0)")

    def _refresh(self, plan: _Plan) -> Check | None:
        for factor in self.factors:
            moment = plan.moments[factor]
            _, vectors = _decomposed(moment, self._name(plan.layer, factor), self._inverse_dtype)
            plan.transform[f"{factor}_eigenvectors"] = vectors.to(moment.dtype)
        return None  # (nothing inverted: no condition to check)

    def _direction(self, plan: _Plan, matrix: Tensor) -> tuple[Tensor, dict[str, Any]]:
        group, state = plan.layer.group, plan.state
        beta1, beta2 = group["adam_betas"]
        right = plan.transform["input_eigenvectors"].to(matrix.dtype)
        left = plan.transform["output_grad_eigenvectors"].to(matrix.dtype)
        rotated = left.mT @ matrix @ right
        exp_avg, exp_avg_sq = state.get("exp_avg"), state.get("exp_avg_sq")
        if exp_avg is None or exp_avg_sq is None:
            exp_avg, exp_avg_sq = torch.zeros_like(rotated), torch.zeros_like(rotated)
        elif plan.refreshed and "input_eigenvectors" in state:  # the first moment, into the new bases
            old_right = state["input_eigenvectors"].to(matrix.dtype)
            old_left = state["output_grad_eigenvectors"].to(matrix.dtype)
            exp_avg = (left.mT @ old_left) @ exp_avg.to(matrix.dtype) @ (old_right.mT @ right)
        step = state.get("step", 0) + 1
        exp_avg = exp_avg.to(matrix.dtype).lerp(rotated, 1 - beta1)
        exp_avg_sq = exp_avg_sq.to(matrix.dtype).mul(beta2).addcmul(rotated, rotated, value=1 - beta2)
        denominator = (exp_avg_sq / (1 - beta2**step)).sqrt().add(group["adam_eps"])
        adam = (exp_avg / (1 - beta1**step)) / denominator
        return left @ adam @ right.mT, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "step": step}
