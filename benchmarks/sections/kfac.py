"""Section 8: K-FAC's step time against AdamW, and its convergence on digits beside FOOF, SGD and AdamW."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from inputaware_optim import KFAC

from .. import digits as shared
from ..core import Config, Progress, Result, Section, Table, Target, format_seconds
from ..digits import BATCH, Factory, Sweep
from ..timing import Timing
from .foof import DAMPING as FOOF_DAMPING
from .foof import foof, foof_sweep

UPDATE_EVERY = (1, 10)
TRAINED_UPDATE_EVERY = 10
# K-FAC damps each factor by √λ. The default λ = 1e-3 (√λ ≈ 0.03) diverges on these models at every
# swept learning rate of the CNN and at lr >= 0.01 on the MLP; λ = 0.1 (√λ ≈ 0.32) keeps most of the
# sweep stable. Fixed (not swept), as FOOF's damping is, so that K-FAC gets no more tuning than the others.
DAMPING = 0.1
KFAC_NAME = f"K-FAC (update_every={TRAINED_UPDATE_EVERY})"
FOOF_NAME = f"FOOF (update_every={TRAINED_UPDATE_EVERY})"


def kfac(update_every: int) -> Factory:
    """K-FAC with momentum 0.9, this section's damping and the given ``update_every``."""
    return lambda model, lr: KFAC(model, lr=lr, momentum=0.9, damping=DAMPING, update_every=update_every)


def _step_times(build: Callable[[], nn.Module], digits: shared.Digits, config: Config) -> Timing:
    """Interleaved training-step times of AdamW, SGD, FOOF and K-FAC at each ``update_every``."""
    variants: dict[str, tuple[Factory, float]] = {
        "AdamW": (lambda m, lr: torch.optim.AdamW(m.parameters(), lr=lr), 1e-4),
        "SGD (momentum 0.9)": (lambda m, lr: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9), 1e-3),
        FOOF_NAME: (foof(TRAINED_UPDATE_EVERY), 1e-3),
    }
    multiples = {FOOF_NAME: TRAINED_UPDATE_EVERY}
    for every in UPDATE_EVERY:
        variants[f"K-FAC (update_every={every})"] = (kfac(every), 1e-3)
        multiples[f"K-FAC (update_every={every})"] = every
    return shared.step_times(build, digits, BATCH, variants, config, multiple_of=multiples)


def run(config: Config, progress: Progress) -> Result:
    sweeps = [
        *shared.baseline_sweeps(config),
        foof_sweep(config),
        Sweep(
            KFAC_NAME,
            kfac(TRAINED_UPDATE_EVERY),
            shared.sweep(config, (0.003, 0.01, 0.03, 0.1)),
            "K-FAC (Kronecker factors from the inputs and the output gradients, momentum 0.9), inverses refreshed "
            f"every {TRAINED_UPDATE_EVERY} steps",
        ),
    ]
    models = shared.models()
    steps, eval_every = config.pick(12, 360, 720), config.pick(6, 10, 20)
    progress.start(len(models) * (1 + sum(len(o.learning_rates) for o in sweeps)))
    data: dict[str, Any] = {"batch": BATCH, "steps": steps, "eval_every": eval_every, "damping": DAMPING}
    timing_rows, convergence_rows, targets, plots = [], [], [], []
    for model_name, (build, images, description) in models.items():
        digits = shared.load(config.seed, images)
        progress.describe(f"{model_name} step times")
        timing = _step_times(build, digits, config)
        progress.advance()
        adamw_seconds = timing.per_call("AdamW")
        ratios = {name: timing.ratio(name, "AdamW") for name in timing.seconds}
        per_step = {name: adamw_seconds * ratio.median for name, ratio in ratios.items()}
        timing_rows += [
            [model_name, name, format_seconds(timing.per_call(name)), ratio.shown()] for name, ratio in ratios.items()
        ]
        result = shared.converge(build, digits, sweeps, per_step, steps, eval_every, config, progress, model_name)
        convergence_rows += result.rows(model_name)
        reach, best = result.reach, result.best
        kfac_seconds, adamw_reach = reach[KFAC_NAME]["seconds"], reach["AdamW"]["seconds"]
        diverged = [f"{r['lr']:g}" for r in result.runs[KFAC_NAME] if r["diverged"]]
        targets.append(
            Target.at_most(
                f"K-FAC time to AdamW's final test accuracy, digits {model_name} (informational)",
                None if kfac_seconds is None or not adamw_reach else kfac_seconds / adamw_reach,
                1.0,
                "× AdamW's time",
                f"informational: FOOF's bar (< 1× AdamW's time) applied to K-FAC. AdamW's final accuracy "
                f"{100 * result.goal:.1f}%: AdamW reaches it at step {reach['AdamW']['step']}, K-FAC "
                f"{shared.at_step(reach[KFAC_NAME]['step'])} (best K-FAC accuracy "
                f"{100 * max(best[KFAC_NAME]['test_accuracy']):.1f}%), FOOF {shared.at_step(reach[FOOF_NAME]['step'])}"
                + (f"; K-FAC diverged at lr {', '.join(diverged)}" if diverged else ""),
                strict=True,
                source="informational",
            ).full_size_only(config)
        )
        data[model_name] = {
            "description": description,
            "step_timing": timing.to_json(),
            "ratios_vs_adamw": {name: ratio.__dict__ for name, ratio in ratios.items()},
            "seconds_per_step": per_step,
            "runs": result.runs,
            "best_lr": {name: chosen["lr"] for name, chosen in best.items()},
            "adamw_final_test_accuracy": result.goal,
            "time_to_adamw_accuracy": reach,
        }
        plots.append(
            shared.convergence_plot(
                "K-FAC beside FOOF, SGD and AdamW",
                model_name,
                description,
                sweeps,
                best,
                per_step,
                headline=False,
                goal=result.goal,
            )
        )
    tables = [
        Table(
            f"Training step time (zero_grad, forward, backward, step) on digits, batch {BATCH}, ratio vs AdamW",
            ["model", "optimizer", "step time", "ratio vs AdamW"],
            timing_rows,
            "K-FAC's step adds, per layer, both factors' statistics (x̃x̃ᵀ from the inputs, ggᵀ from the output "
            "gradients) and the two-sided product (Ḡ + √λI)⁻¹ G̃ (Ā + √λI)⁻¹; every update_every steps, two "
            "Cholesky inverses in float64. Samples span whole multiples of update_every. "
            f"K-FAC damping λ = {DAMPING:g}, FOOF damping {FOOF_DAMPING:g}.",
        ),
        Table(
            f"Convergence on digits: {steps} steps of batch {BATCH}; best learning rate of each sweep by "
            "final validation accuracy",
            shared.CONVERGENCE_COLUMNS,
            convergence_rows,
            "Time = steps × the optimizer's step time from the interleaved timing above. Learning rates swept: "
            + shared.sweeps_swept(sweeps)
            + ". A K-FAC run whose damped statistics stop being positive definite (the library raises, asking "
            "for more damping) or whose loss stops being finite counts as diverged. The same models, data split "
            "and sweeps as the FOOF section.",
        ),
    ]
    return Result(tables=tables, targets=targets, plots=plots, data=data)


SECTION = Section(
    name="kfac",
    title="K-FAC: step time and convergence on digits",
    summary=(
        "`KFAC(model, lr, momentum=0.9, damping=0.1, update_every=...)` (Kronecker factors from the inputs "
        "and the output gradients) beside FOOF, SGD with momentum and AdamW: the training step interleaved "
        "for `update_every` 1 and 10, then training on scikit-learn's digits with the MLP and small CNN of the "
        "FOOF section, each optimizer with a small learning-rate sweep, the best taken by validation "
        "accuracy. Curves against steps and against seconds (steps × the interleaved step time)."
    ),
    run=run,
    estimate=(2, 35),
)
