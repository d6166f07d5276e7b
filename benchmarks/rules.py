"""FOOF, K-FAC and Eva as the benchmark sections configure them: damping, schedule, learning-rate sweeps.

Every rule is timed and trained on one schedule: statistics every ``STATISTICS_EVERY`` steps,
and (FOOF, K-FAC) the inverses refreshed on each of those statistics steps (``update_every=1``),
so nine steps in ten only apply the kept preconditioner. A timed sample spans whole multiples of
``STATISTICS_EVERY`` steps, so it holds its share of the statistics and inverse steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from inputaware_optim import FOOF, KFAC, Eva, InputAwareOptimizer, WhitenedMuonPreconditioner, layer_kind
from inputaware_optim.layers import bias_of, weight_of
from inputaware_optim.whitened_muon import muon_rms_scale, polar

from . import baselines
from .candidates import EigenbasisAdam, TwoSidedMuon
from .core import Config, Progress, Target, format_seconds
from .digits import BATCH, Factory, Sweep, baseline_sweeps, load, sweep, tasks
from .digits import step_times as shared_step_times
from .timing import Ratio

__all__ = [
    "CANDIDATE_DAMPING",
    "EIGENBASIS_ADAM",
    "EVA_DAMPING",
    "FOOF_DAMPING",
    "FOOF_ON_MUON",
    "INVERSE_DTYPE",
    "KFAC_DAMPING",
    "LARGE_BATCH",
    "ROOTS_SCHEDULE",
    "SCHEDULE",
    "STATISTICS_EVERY",
    "STEP_LIMIT",
    "STEP_TABLE_NOTE",
    "TIMING_LR",
    "TWO_SIDED_MUON",
    "UPDATE_EVERY",
    "WHITENED_MUON",
    "CandidateFloor",
    "KernelFloor",
    "StepTimes",
    "candidate_floor",
    "candidate_sweeps",
    "eigenbasis_adam",
    "eva",
    "foof",
    "foof_on_muon",
    "geometry_sweeps",
    "kernel_floor",
    "kfac",
    "kronecker_parameters",
    "step_target",
    "step_times",
    "two_sided_muon",
    "whitened_muon",
]

STATISTICS_EVERY = 10
UPDATE_EVERY = 1  # inverses refreshed every statistics step: every STATISTICS_EVERY steps
SCHEDULE = f"statistics and inverses every {STATISTICS_EVERY} steps (Cholesky in float32)"
# FOOF's default damping (1e-3) lets these models diverge at learning rates >= 0.03; 0.1 keeps the
# whole sweep stable. K-FAC's λ (split between its factors by their mean eigenvalues, as Martens &
# Grosse): its default, 0.1; at 0.01 it diverges on the digits CNN at learning rates 0.03-0.3. Eva
# keeps its defaults, KL clipping included (0.001: unclipped, it diverges on the CNN at learning
# rates >= 0.03 and on the autoencoder at 0.3). Fixed (not swept), so that no rule gets more tuning
# than the stock optimizers.
FOOF_DAMPING = 0.1
KFAC_DAMPING = 0.1
EVA_DAMPING = 0.03
# Cholesky in float32: as exact as float64 here (the inversion section: relative error of the
# preconditioned gradient at most about 3e-7 at every factor size and damping, against 2e-7 in
# float64) and 0.6-0.95x its time. (Eva inverts nothing.)
INVERSE_DTYPE = torch.float32
# The rules' extra work per layer (statistics, the preconditioning product) is about in² (out + batch)
# multiply-adds against the layer's own 3 · batch · in · out, so their relative cost falls as the
# batch grows: the trained schedule is timed at this batch too.
LARGE_BATCH = 512
# The learning rate of every timed step: small, so that thousands of steps on one batch stay finite
# (a step's work does not depend on it).
TIMING_LR = 1e-5


def foof(
    statistics_every: int = STATISTICS_EVERY, update_every: int = UPDATE_EVERY, adamw: bool = False, **options: Any
) -> Factory:
    """FOOF with this module's damping and the given schedule; in front of ``torch.optim.AdamW`` if ``adamw``;
    ``options``: FOOF's other arguments (``params``, ``base=`` and the base's)."""
    extra: dict[str, Any] = {"base": torch.optim.AdamW} if adamw else {}
    return lambda model, lr: FOOF(
        model,
        lr=lr,
        damping=FOOF_DAMPING,
        update_every=update_every,
        statistics_every=statistics_every,
        inverse_dtype=INVERSE_DTYPE,
        **extra,
        **options,
    )


def kfac(
    statistics_every: int = STATISTICS_EVERY,
    update_every: int = UPDATE_EVERY,
    base: type[torch.optim.Optimizer] | None = None,
) -> Factory:
    """K-FAC with this module's damping and the given schedule: SGD with momentum 0.9, or in front of
    ``base`` (``torch.optim.AdamW``, ...) with the base's defaults."""
    extra: dict[str, Any] = {"momentum": 0.9} if base is None else {"base": base}
    return lambda model, lr: KFAC(
        model,
        lr=lr,
        damping=KFAC_DAMPING,
        update_every=update_every,
        statistics_every=statistics_every,
        inverse_dtype=INVERSE_DTYPE,
        **extra,
    )


def eva(statistics_every: int = STATISTICS_EVERY, base: type[torch.optim.Optimizer] | None = None) -> Factory:
    """Eva with its default damping and KL clipping, statistics every ``statistics_every`` steps: SGD
    with momentum 0.9, or in front of ``base`` with the base's defaults."""
    extra: dict[str, Any] = {"momentum": 0.9} if base is None else {"base": base}
    return lambda model, lr: Eva(model, lr=lr, damping=EVA_DAMPING, statistics_every=statistics_every, **extra)


def foof_on_muon() -> Factory:
    """Muon's recipe (``baselines.muon``) with FOOF in front of its Muon part: FOOF preconditions the
    hidden matrices' gradients (this module's damping and schedule) and Muon orthogonalizes them;
    AdamW takes the rest."""

    def build(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        def hidden_part(params: list[Tensor], lr: float, **muon_options: Any) -> torch.optim.Optimizer:
            return foof(params=params, base=baselines.Float32Muon, **muon_options)(model, lr)

        return baselines.muon(model, lr, hidden_part)

    return build


FOOF_ON_MUON = (
    f"FOOF's preconditioned gradient of the hidden matrices handed to Muon (base=Muon, float32 Newton–Schulz, "
    f"the Muon recipe's part), {SCHEDULE}; AdamW on the rest, as in the Muon recipe"
)


# The issue-44 candidates (benchmarks/candidates.py) on the same schedule, with FOOF's fixed damping (the same
# absolute amount on the input factor: (a) adds it to Ā, (b) splits it between its factors as K-FAC does) and every
# other hyperparameter at the rule's default (Muon's momentum 0.95 and Nesterov; Adam's betas and eps).
CANDIDATE_DAMPING = FOOF_DAMPING


def whitened_muon(two_sided: bool = False) -> Factory:
    """Muon's recipe (``baselines.muon``) with its Muon part replaced by the library's
    ``WhitenedMuonPreconditioner`` (the candidate ``TwoSidedMuon`` if ``two_sided``) in front of ``torch.optim.SGD``
    without momentum, on the hidden matrices: the rule applies Muon's momentum, takes its polar step in the whitened
    metric and scales it as the recipe does, and SGD's step with the recipe's weight decay is then Muon's; AdamW
    takes the rest (their biases included), as in the recipe."""
    rule = TwoSidedMuon if two_sided else WhitenedMuonPreconditioner

    def build(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        def hidden_part(params: list[Tensor], lr: float, weight_decay: float, **muon_options: Any) -> Any:
            # (muon_options: adjust_lr_fn="match_rms_adamw", the scaling the rule applies itself)
            candidate = rule(
                CANDIDATE_DAMPING,
                update_every=UPDATE_EVERY,
                statistics_every=STATISTICS_EVERY,
                inverse_dtype=INVERSE_DTYPE,
            )
            return InputAwareOptimizer(
                model, params=params, rules=[candidate], base=torch.optim.SGD, lr=lr, weight_decay=weight_decay
            )

        return baselines.muon(model, lr, hidden_part)

    return build


def two_sided_muon() -> Factory:
    """``whitened_muon(two_sided=True)``: the recipe's Muon part replaced by ``TwoSidedMuon``."""
    return whitened_muon(two_sided=True)


def kronecker_parameters(model: torch.nn.Module) -> list[Tensor]:
    """The weights and biases of the layers whose registered kind has input and output-gradient rows (one block)."""
    found: list[Tensor] = []
    for module in model.modules():
        kind = layer_kind(module)
        if kind is None or not kind.provides("output_grad_rows") or kind.blocks(module) != 1:
            continue
        for param in (weight_of(module), bias_of(module)):
            if param is not None and param.requires_grad and not any(param is p for p in found):
                found.append(param)
    return found


def eigenbasis_adam() -> Factory:
    """``EigenbasisAdam`` in front of ``torch.optim.SGD`` without momentum on every layer with Kronecker factors
    (first and last included, biases folded in: it is an Adam, and replaces AdamW wherever the factors exist, as FOOF
    in front of AdamW covers every layer), AdamW on the rest (embeddings, norms), one learning rate and the recipe's
    weight decay: SGD's step is then AdamW's decoupled one in the rotated coordinates."""

    def build(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        covered = kronecker_parameters(model)
        chosen = {id(p) for p in covered}
        rest = [p for p in model.parameters() if id(p) not in chosen]
        parts: list[torch.optim.Optimizer] = []
        if covered:
            candidate = EigenbasisAdam(
                update_every=UPDATE_EVERY, statistics_every=STATISTICS_EVERY, inverse_dtype=INVERSE_DTYPE
            )
            parts.append(
                InputAwareOptimizer(
                    model,
                    params=covered,
                    rules=[candidate],
                    base=torch.optim.SGD,
                    lr=lr,
                    weight_decay=baselines.WEIGHT_DECAY,
                )
            )
        if rest:
            parts.append(torch.optim.AdamW(rest, lr=lr, weight_decay=baselines.WEIGHT_DECAY))
        return baselines.Combined(parts)

    return build


ROOTS_SCHEDULE = f"statistics and inverse roots every {STATISTICS_EVERY} steps (eigh in float32)"
WHITENED_MUON = (
    f"Muon's polar step in the input-whitened metric, polar(M A^-1/2) A^-1/2 (WhitenedMuon, damping "
    f"{CANDIDATE_DAMPING:g}, Muon's momentum and RMS scaling, float32 Newton–Schulz) in front of SGD without momentum "
    f"on the hidden matrices, {ROOTS_SCHEDULE}; AdamW on the rest, as in the Muon recipe"
)
TWO_SIDED_MUON = (
    f"Muon's polar step two-sided, B^-1/2 polar(B^-1/2 M A^-1/2) A^-1/2 with K-FAC's output-gradient factor "
    f"normalized to mean eigenvalue 1 (TwoSidedMuon, damping {CANDIDATE_DAMPING:g} split as K-FAC's) in front of SGD "
    f"without momentum on the hidden matrices, {ROOTS_SCHEDULE}; AdamW on the rest, as in the Muon recipe"
)
EIGENBASIS_ADAM = (
    f"Adam (betas 0.9, 0.999) in the eigenbases of the input and output-gradient Kronecker factors (EigenbasisAdam: "
    f"SOAP's idea on K-FAC's factors) in front of SGD without momentum on every layer with both factors, eigenbases "
    f"refreshed on the statistics steps ({SCHEDULE.replace('inverses', 'eigenbases').replace('Cholesky', 'eigh')}); "
    f"AdamW on the rest"
)


def candidate_sweeps(config: Config) -> list[Sweep]:
    """FOOF, K-FAC, Eva and FOOF in front of AdamW and of Muon on ``SCHEDULE``, each with its learning-rate sweep."""
    return [
        Sweep(
            "FOOF",
            foof(),
            sweep(config, (0.003, 0.01, 0.03, 0.1, 0.3)),
            f"FOOF (the gradient preconditioned by the layer inputs' damped second moment, SGD momentum 0.9, "
            f"damping {FOOF_DAMPING:g}), {SCHEDULE}",
        ),
        Sweep(
            "K-FAC",
            kfac(),
            sweep(config, (0.003, 0.01, 0.03, 0.1, 0.3)),
            f"K-FAC (Kronecker factors from the inputs and the output gradients, momentum 0.9, damping "
            f"λ = {KFAC_DAMPING:g}), {SCHEDULE}",
        ),
        Sweep(
            "Eva",
            eva(),
            sweep(config, (0.01, 0.03, 0.1, 0.3, 1.0)),
            f"Eva (K-FAC with rank-one Kronecker vectors and closed-form inverses, momentum 0.9, damping "
            f"{EVA_DAMPING:g}, KL clipping 0.001), statistics every {STATISTICS_EVERY} steps",
        ),
        Sweep(
            "FOOF on AdamW",
            foof(adamw=True),
            sweep(config, (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)),
            f"FOOF's preconditioned gradient handed to torch.optim.AdamW (base=torch.optim.AdamW), {SCHEDULE}",
        ),
        Sweep("FOOF on Muon", foof_on_muon(), sweep(config, (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)), FOOF_ON_MUON),
    ]


def geometry_sweeps(config: Config, rates: tuple[float, ...] | None = None) -> list[Sweep]:
    """The issue-44 candidates (``WhitenedMuon``, ``TwoSidedMuon``, ``EigenbasisAdam``), each sweeping ``rates``
    (default: the digits' AdamW and Muon rates; Muon's update is scaled to AdamW's RMS and the candidates follow
    their recipes, so one sweep serves all three)."""
    rates = rates or sweep(config, (3e-4, 1e-3, 3e-3, 1e-2, 3e-2))
    return [
        Sweep("Whitened Muon", whitened_muon(), rates, WHITENED_MUON),
        Sweep("Two-sided Muon", two_sided_muon(), rates, TWO_SIDED_MUON),
        Sweep("Eigenbasis Adam", eigenbasis_adam(), rates, EIGENBASIS_ADAM),
    ]


class KernelFloor:
    """A stock optimizer plus a Kronecker rule's arithmetic alone, with no capture and no library code.

    Mixed in front of the base optimizer's class (``kernel_floor`` builds the pair): every step
    multiplies each ``nn.Linear`` / ``nn.Conv2d`` gradient matrix ``[W | b]`` by kept inverses
    (``G̃ A⁻¹``; two-sided ``G⁻¹ G̃ A⁻¹`` for K-FAC), then takes the base's step. Every
    ``statistics_every`` steps it first forms each factor's statistics product (``x̃ᵀx̃`` over
    the layer's rows of a step, and ``gᵀg`` for K-FAC) over the rows' count, averages it into the
    running moment (the rules' ``stat_decay``), adds the damping to a copy and Cholesky-inverts it
    in ``inverse_dtype``: the schedule the benchmarks train the rules on (inverses refreshed on
    every statistics step). The rows are fixed random tensors of the shapes the layer saw at its
    first forward (a hook takes itself off after it: no hook runs while timed); the values do not
    change the time. The least time FOOF's or K-FAC's step can take: the rest is overhead.
    """

    def _set_up_floor(self, model: torch.nn.Module, two_sided: bool, statistics_every: int, dtype: torch.dtype) -> None:
        self._floor_layers: list[_FloorLayer] = []
        self._floor_every, self._floor_dtype, self._floor_steps = statistics_every, dtype, 0
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
                layer = _FloorLayer(module, two_sided)
                self._floor_layers.append(layer)
                layer.handle = module.register_forward_hook(layer.shape_rows)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self._floor_steps % self._floor_every == 0:
            for layer in self._floor_layers:
                layer.invert(self._floor_dtype)
        self._floor_steps += 1
        for layer in self._floor_layers:
            layer.precondition()
        return super().step(closure)  # type: ignore[misc]


class _FloorLayer:
    """One layer's share of ``KernelFloor``: its rows, factors and kept inverses."""

    def __init__(self, module: Any, two_sided: bool) -> None:  # (an nn.Linear or nn.Conv2d)
        self.weight: Tensor = module.weight
        self.bias: Tensor | None = module.bias
        self.columns = module.weight[0].numel() + (module.bias is not None)
        self.outputs = module.weight.shape[0]
        self.two_sided = two_sided
        self.rows: list[Tensor] = []  # the input rows (and output-gradient rows) of a step
        self.inverses = [torch.eye(n) for n in (self.columns, self.outputs)[: 1 + two_sided]]
        self.moments: list[Tensor | None] = [None] * (1 + two_sided)  # the running averages
        self.handle: Any = None

    def shape_rows(self, module: torch.nn.Module, args: Any, output: Tensor) -> None:
        self.handle.remove()
        count = output.numel() // self.outputs  # rows: samples (and positions) of the call
        generator = torch.Generator().manual_seed(self.columns)
        self.rows = [
            torch.randn(count, n, generator=generator) for n in (self.columns, self.outputs)[: 1 + self.two_sided]
        ]

    def invert(self, dtype: torch.dtype) -> None:
        for index, rows in enumerate(self.rows):
            moment = (rows.mT @ rows) / rows.shape[0]
            previous = self.moments[index]  # the rules' running average (stat_decay 0.95)
            moment = self.moments[index] = moment if previous is None else torch.lerp(previous, moment, 0.05)
            damped = moment.to(dtype, copy=True)  # (the average is kept: damped in a copy)
            damped.diagonal().add_(0.1)
            self.inverses[index] = torch.cholesky_inverse(torch.linalg.cholesky(damped)).to(moment.dtype)

    def precondition(self) -> None:
        weight, bias = self.weight, self.bias
        if weight.grad is None:
            return
        grad = weight.grad.reshape(weight.shape[0], -1)
        matrix = grad if bias is None or bias.grad is None else torch.cat((grad, bias.grad.unsqueeze(1)), dim=1)
        new = matrix @ self.inverses[0] if not self.two_sided else self.inverses[1] @ matrix @ self.inverses[0]
        grad.copy_(new[:, : grad.shape[1]])
        if bias is not None and matrix is not grad:
            bias.grad.copy_(new[:, -1])  # type: ignore[union-attr]


_FLOOR_CLASSES: dict[tuple[type[torch.optim.Optimizer], type], type] = {}


def _floor_class(base: type[torch.optim.Optimizer], floor: type = KernelFloor) -> type:
    """``floor`` (``KernelFloor`` or ``CandidateFloor``) mixed in front of ``base`` (one class per pair)."""
    if (base, floor) not in _FLOOR_CLASSES:
        _FLOOR_CLASSES[base, floor] = type(f"{floor.__name__}{base.__name__}", (floor, base), {})
    return _FLOOR_CLASSES[base, floor]


def kernel_floor(
    two_sided: bool = False,
    base: type[torch.optim.Optimizer] | None = None,
    statistics_every: int = STATISTICS_EVERY,
    **base_kwargs: Any,
) -> Factory:
    """``(model, lr) -> optimizer``: ``base`` (default SGD with momentum 0.9) plus FOOF's arithmetic
    alone, or K-FAC's (``two_sided``), on this module's schedule (``KernelFloor``)."""
    if base is None:
        base, base_kwargs = torch.optim.SGD, {"momentum": 0.9, **base_kwargs}
    cls = _floor_class(base)

    def build(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        optimizer = cls(model.parameters(), lr=lr, **base_kwargs)
        optimizer._set_up_floor(model, two_sided, statistics_every, INVERSE_DTYPE)
        return optimizer  # type: ignore[no-any-return]

    return build


class CandidateFloor(KernelFloor):
    """``KernelFloor`` for an issue-44 candidate: its base (SGD without momentum) plus the candidate's arithmetic
    alone on the layers whose weight it trains, with no capture and no rule machinery (the library's ``polar`` and
    ``muon_rms_scale`` are the arithmetic itself; ``candidate_floor`` builds it).

    Every ``statistics_every`` steps each layer's statistics products and running moments, as ``KernelFloor``'s, then
    ``torch.linalg.eigh`` of each factor in ``inverse_dtype`` and what the candidate forms from it (the damped inverse
    roots; for Adam in the eigenbasis the eigenvectors, and its first moment rotated into them); every step the
    candidate's own work: Muon's momentum, the whitening products and 5 Newton–Schulz steps, or the rotations and
    Adam's moments. The least time the candidate's step can take: the rest is overhead.
    """

    def _set_up_candidate_floor(
        self, model: torch.nn.Module, candidate: str, statistics_every: int, dtype: torch.dtype
    ) -> None:
        trained = {id(p) for group in self.param_groups for p in group["params"]}  # type: ignore[attr-defined]
        self._floor_layers = []
        self._floor_every, self._floor_dtype, self._floor_steps = statistics_every, dtype, 0
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)) and id(module.weight) in trained:
                homogeneous = module.bias is not None and id(module.bias) in trained
                layer = _CandidateFloorLayer(module, candidate, homogeneous)
                self._floor_layers.append(layer)
                layer.handle = module.register_forward_hook(layer.shape_rows)


class _CandidateFloorLayer(_FloorLayer):
    """One layer's share of ``CandidateFloor``: its rows, factors, kept transform and the candidate's moments."""

    def __init__(self, module: Any, candidate: str, homogeneous: bool) -> None:
        super().__init__(module, two_sided=candidate != "whitened_muon")
        self.candidate = candidate
        if not homogeneous:  # (the bias is another optimizer's: not a column of W̃)
            self.bias, self.columns = None, module.weight[0].numel()
        self.inverses = [torch.eye(self.columns), torch.eye(self.outputs)]  # R (or Q_A), L (or Q_B)
        shape = (self.outputs, self.columns)
        self.first, self.second, self.steps = torch.zeros(shape), torch.zeros(shape), 0

    def invert(self, dtype: torch.dtype) -> None:
        moments = []
        for index, rows in enumerate(self.rows):
            moment = (rows.mT @ rows) / rows.shape[0]
            previous = self.moments[index]
            moments.append(moment if previous is None else torch.lerp(previous, moment, 0.05))
            self.moments[index] = moments[-1]
        values, vectors = zip(*(torch.linalg.eigh(m.to(dtype)) for m in moments), strict=True)
        if self.candidate == "eigenbasis_adam":
            old_right, old_left = self.inverses
            right, left = (v.to(moments[0].dtype) for v in vectors)
            self.first = (left.mT @ old_left) @ self.first @ (old_right.mT @ right)
            self.inverses = [right, left]
            return
        damping = [CANDIDATE_DAMPING]
        if self.two_sided:  # B̂ = B / m_B, K-FAC's split of λ
            values = (values[0], values[1] / values[1].mean())
            pi = (values[0].mean() / values[1].mean()).sqrt()
            damping = [pi * CANDIDATE_DAMPING**0.5, CANDIDATE_DAMPING**0.5 / pi]
        self.inverses[: len(moments)] = [
            ((q * (v.clamp_min(0) + d).rsqrt()) @ q.mT).to(m.dtype)
            for v, q, d, m in zip(values, vectors, damping, moments, strict=True)
        ]

    def precondition(self) -> None:
        weight, bias = self.weight, self.bias
        if weight.grad is None:
            return
        grad = weight.grad.reshape(weight.shape[0], -1)
        matrix = grad if bias is None or bias.grad is None else torch.cat((grad, bias.grad.unsqueeze(1)), dim=1)
        right, left = self.inverses
        if self.candidate == "eigenbasis_adam":
            rotated = left.mT @ matrix @ right
            self.steps += 1
            self.first.lerp_(rotated, 0.1)
            self.second.mul_(0.999).addcmul_(rotated, rotated, value=0.001)
            adam = (self.first / (1 - 0.9**self.steps)) / (self.second / (1 - 0.999**self.steps)).sqrt().add_(1e-8)
            new = left @ adam @ right.mT
        else:  # (first: Muon's momentum buffer)
            self.first.lerp_(matrix, 0.05)
            update = matrix.lerp(self.first, 0.95)
            inner = update @ right if not self.two_sided else left @ update @ right
            ortho = polar(inner)
            new = ortho @ right if not self.two_sided else left @ ortho @ right
            new = new * muon_rms_scale(matrix.shape)
        grad.copy_(new[:, : grad.shape[1]])
        if bias is not None and matrix is not grad:
            bias.grad.copy_(new[:, -1])  # type: ignore[union-attr]


def candidate_floor(candidate: str, statistics_every: int = STATISTICS_EVERY) -> Factory:
    """``(model, lr) -> optimizer``: the arithmetic floor of ``whitened_muon()``, ``two_sided_muon()`` or
    ``eigenbasis_adam()`` (``candidate``: their name), split as they split the model: ``CandidateFloor`` (SGD
    without momentum) on the candidate's parameters, AdamW on the rest."""
    if candidate not in ("whitened_muon", "two_sided_muon", "eigenbasis_adam"):
        raise ValueError(f"Invalid candidate: {candidate!r}")
    cls = _floor_class(torch.optim.SGD, CandidateFloor)

    def part(model: torch.nn.Module, params: list[Tensor], lr: float) -> torch.optim.Optimizer:
        optimizer = cls(params, lr=lr, weight_decay=baselines.WEIGHT_DECAY)
        optimizer._set_up_candidate_floor(model, candidate, statistics_every, INVERSE_DTYPE)
        return optimizer  # type: ignore[no-any-return]

    def build(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        if candidate != "eigenbasis_adam":
            return baselines.muon(model, lr, lambda params, lr, **options: part(model, params, lr))
        covered = kronecker_parameters(model)
        rest = [p for p in model.parameters() if all(p is not q for q in covered)]
        parts = [part(model, covered, lr)] if covered else []
        if rest:
            parts.append(torch.optim.AdamW(rest, lr=lr, weight_decay=baselines.WEIGHT_DECAY))
        return baselines.Combined(parts)

    return build


STEP_LIMIT = 1.15  # the step-time target of FOOF and K-FAC against AdamW


@dataclass
class StepTimes:
    """Interleaved training-step times of the digits classifiers, stock optimizers beside some rules.

    Attributes:
        rows: Table rows: model, batch, optimizer, step time, ratio vs AdamW.
        ratios: ``ratios[model][batch][optimizer]``: the ratio vs AdamW.
        data: The raw timings and ratios, for the JSON.
    """

    rows: list[list[str]]
    ratios: dict[str, dict[int, dict[str, Ratio]]]
    data: dict[str, Any]


def step_times(
    config: Config, progress: Progress, rules: dict[str, tuple[Factory, int]], large: tuple[str, ...]
) -> StepTimes:
    """Time AdamW, SGD and each rule (factory, period of its schedule) on the digits MLP and CNN.

    At batch ``BATCH`` every rule is timed; at ``LARGE_BATCH`` the rules named in ``large`` (not
    at size quick). One progress unit per model and batch.
    """
    stock: dict[str, tuple[Factory, float]] = {
        sweep.name: (sweep.factory, TIMING_LR) for sweep in baseline_sweeps(config)
    }
    rows: list[list[str]] = []
    ratios: dict[str, dict[int, dict[str, Ratio]]] = {}
    data: dict[str, Any] = {}
    for name, task in tasks().items():
        if task.reconstruct:
            continue
        digits = load(config.seed, task.images)
        ratios[name], data[name] = {}, {}
        for batch, timed in ((BATCH, tuple(rules)), (LARGE_BATCH, config.pick((), large))):
            if not timed:
                continue
            progress.describe(f"{name} batch {batch} step times")
            variants = {**stock, **{rule: (rules[rule][0], TIMING_LR) for rule in timed}}
            timing = shared_step_times(
                task, digits, batch, variants, config, multiple_of={rule: rules[rule][1] for rule in timed}
            )
            progress.advance()
            ratios[name][batch] = {variant: timing.ratio(variant, "AdamW") for variant in variants}
            rows += [
                [name, str(batch), variant, format_seconds(timing.per_call(variant)), ratio.shown()]
                for variant, ratio in ratios[name][batch].items()
            ]
            data[name][str(batch)] = {
                "timing": timing.to_json(),
                "ratios_vs_adamw": {variant: ratio.__dict__ for variant, ratio in ratios[name][batch].items()},
            }
    return StepTimes(rows, ratios, data)


def step_target(
    rule: str,
    model: str,
    ratio: Ratio,
    config: Config,
    informational: bool = False,
    schedule: str = SCHEDULE,
    floor: Ratio | None = None,
) -> Target:
    """``rule``'s step on ``SCHEDULE`` against AdamW's, digits ``model``, batch ``BATCH``: at most
    ``STEP_LIMIT``; ``floor``: the ratio of the rule's arithmetic alone (``KernelFloor``), reported beside."""
    alone = (
        ""
        if floor is None
        else f"; its arithmetic alone (SGD, statistics products, inverses, products; no capture): {floor.median:.2f}×"
    )
    return Target.at_most(
        f"{rule} training step vs AdamW, {schedule}, digits {model}" + (" (informational)" if informational else ""),
        ratio.median,
        STEP_LIMIT,
        "×",
        f"{'informational: the bar of FOOF and K-FAC applied to ' + rule + '; ' if informational else ''}"
        f"rounds {ratio.low:.3f}–{ratio.high:.3f}; batch {BATCH}{alone}",
        source="informational" if informational else "target",
    ).full_size_only(config)


STEP_TABLE_NOTE = (
    "Each row is the median over interleaved rounds of the optimizer's step time over AdamW's in the same round "
    "(the range over rounds in brackets). A rule's samples span whole multiples of its schedule's period, so each "
    "holds its share of statistics and inverse steps."
)
