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

from inputaware_optim import FOOF, KFAC, Eva

from .core import Config, Progress, Target, format_seconds
from .digits import BATCH, Factory, Sweep, baseline_sweeps, load, sweep, tasks
from .digits import step_times as shared_step_times
from .timing import Ratio

__all__ = [
    "EVA_DAMPING",
    "FOOF_DAMPING",
    "INVERSE_DTYPE",
    "KFAC_DAMPING",
    "LARGE_BATCH",
    "SCHEDULE",
    "STATISTICS_EVERY",
    "STEP_LIMIT",
    "STEP_TABLE_NOTE",
    "TIMING_LR",
    "UPDATE_EVERY",
    "KernelFloor",
    "StepTimes",
    "candidate_sweeps",
    "eva",
    "foof",
    "kernel_floor",
    "kfac",
    "step_target",
    "step_times",
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


def foof(statistics_every: int = STATISTICS_EVERY, update_every: int = UPDATE_EVERY, adamw: bool = False) -> Factory:
    """FOOF with this module's damping and the given schedule; in front of ``torch.optim.AdamW`` if ``adamw``."""
    extra: dict[str, Any] = {"base": torch.optim.AdamW} if adamw else {}
    return lambda model, lr: FOOF(
        model,
        lr=lr,
        damping=FOOF_DAMPING,
        update_every=update_every,
        statistics_every=statistics_every,
        inverse_dtype=INVERSE_DTYPE,
        **extra,
    )


def kfac(statistics_every: int = STATISTICS_EVERY, update_every: int = UPDATE_EVERY) -> Factory:
    """K-FAC with momentum 0.9, this module's damping and the given schedule."""
    return lambda model, lr: KFAC(
        model,
        lr=lr,
        momentum=0.9,
        damping=KFAC_DAMPING,
        update_every=update_every,
        statistics_every=statistics_every,
        inverse_dtype=INVERSE_DTYPE,
    )


def eva(statistics_every: int = STATISTICS_EVERY) -> Factory:
    """Eva with momentum 0.9, its default damping and KL clipping, statistics every ``statistics_every`` steps."""
    return lambda model, lr: Eva(model, lr=lr, momentum=0.9, damping=EVA_DAMPING, statistics_every=statistics_every)


def candidate_sweeps(config: Config) -> list[Sweep]:
    """FOOF, K-FAC, Eva and FOOF in front of AdamW on ``SCHEDULE``, each with its learning-rate sweep."""
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
    ]


class KernelFloor(torch.optim.SGD):
    """SGD with momentum plus a Kronecker rule's arithmetic alone, with no capture and no library code.

    Every step multiplies each ``nn.Linear`` / ``nn.Conv2d`` gradient matrix ``[W | b]`` by kept
    inverses (``G̃ A⁻¹``; two-sided ``G⁻¹ G̃ A⁻¹`` for K-FAC); every ``STATISTICS_EVERY`` steps it
    first Cholesky-inverts each factor in ``INVERSE_DTYPE``. The factors are fixed positive
    definite matrices of the layers' sizes (the values do not change the time). Left out: the
    statistics products (one ``x̃ᵀx̃`` per call every ``STATISTICS_EVERY`` steps), the capture, and
    the bookkeeping. The least time FOOF's or K-FAC's step can take here: the rest is overhead.
    """

    def __init__(self, model: torch.nn.Module, lr: float, two_sided: bool) -> None:
        super().__init__(model.parameters(), lr=lr, momentum=0.9)
        self._layers = []
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
                out, columns = module.weight.shape[0], module.weight[0].numel() + (module.bias is not None)
                factors = [_positive_definite(columns)] + ([_positive_definite(out)] if two_sided else [])
                self._layers.append((module.weight, module.bias, factors, [torch.eye(n) for n in (columns, out)]))
        self._steps = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        refresh = self._steps % STATISTICS_EVERY == 0
        self._steps += 1
        for weight, bias, factors, inverses in self._layers:
            if refresh:
                for i, factor in enumerate(factors):
                    inverses[i] = torch.cholesky_inverse(torch.linalg.cholesky(factor.to(INVERSE_DTYPE))).contiguous()
            grad = weight.grad.reshape(weight.shape[0], -1)
            matrix = grad if bias is None else torch.cat((grad, bias.grad.unsqueeze(1)), dim=1)
            new = matrix @ inverses[0] if len(factors) == 1 else inverses[1] @ matrix @ inverses[0]
            grad.copy_(new[:, : grad.shape[1]])
            if bias is not None:
                bias.grad.copy_(new[:, -1])
        return super().step(closure)


def _positive_definite(size: int) -> Tensor:
    rows = torch.randn(2 * size, size, generator=torch.Generator().manual_seed(size))
    return rows.T @ rows / (2 * size) + 0.1 * torch.eye(size)


def kernel_floor(two_sided: bool = False) -> Factory:
    """``KernelFloor`` as a factory: FOOF's arithmetic alone, or K-FAC's (``two_sided``)."""
    return lambda model, lr: KernelFloor(model, lr, two_sided)


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
        else f"; its arithmetic alone (SGD, the products and inverses, no capture): {floor.median:.2f}×"
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
