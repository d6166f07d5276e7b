"""Section 4: FOOF's training step against AdamW's on digits, on the schedule the convergence section trains with."""

from __future__ import annotations

from .. import rules
from ..core import Config, Progress, Result, Section, Table
from ..digits import BATCH

FOOF = "FOOF"
FOOF_ON_ADAMW = "FOOF on AdamW"
EVERY_STEP = f"FOOF (statistics every step, inverses every {rules.STATISTICS_EVERY})"
ALONE = "FOOF's arithmetic alone"


def run(config: Config, progress: Progress) -> Result:
    every = rules.STATISTICS_EVERY
    timed = {
        FOOF: (rules.foof(), every),
        FOOF_ON_ADAMW: (rules.foof(adamw=True), every),
        EVERY_STEP: (rules.foof(statistics_every=1, update_every=every), every),
        ALONE: (rules.kernel_floor(), every),
    }
    progress.start(4)
    measured = rules.step_times(config, progress, timed, large=(FOOF,))
    targets = [
        rules.step_target(FOOF, model, by_batch[BATCH][FOOF], config, floor=by_batch[BATCH][ALONE])
        for model, by_batch in measured.ratios.items()
    ]
    table = Table(
        "Training step time (zero_grad, forward, backward, step) on digits, ratio vs AdamW",
        ["model", "batch", "optimizer", "step time", "ratio vs AdamW"],
        measured.rows,
        f"{FOOF} and {FOOF_ON_ADAMW} (FOOF's preconditioned gradient handed to torch.optim.AdamW): "
        f"{rules.SCHEDULE}, as trained in the convergence section. {EVERY_STEP}: the input statistics on every "
        f"step, for comparison. {ALONE}: SGD with momentum plus FOOF's products G̃ A⁻¹ every step and, every "
        f"{every} steps, its statistics products x̃ᵀx̃ (averaged into the running moment) and Cholesky "
        "inverses, called directly, with no capture and "
        "no library code: the least FOOF's step can take here. "
        f"{rules.STEP_TABLE_NOTE} At batch {rules.LARGE_BATCH} FOOF's per-layer work "
        "(statistics and the preconditioning product, about in² · (out + batch) multiply-adds) weighs less "
        f"against the layers' own 3 · batch · in · out. FOOF damping {rules.FOOF_DAMPING:g} throughout.",
    )
    data = {"batch": BATCH, "schedule": rules.SCHEDULE, "models": measured.data}
    return Result(tables=[table], targets=targets, data=data)


SECTION = Section(
    name="foof",
    title="FOOF: training step time on digits",
    summary=(
        f"FOOF's training step ({rules.SCHEDULE}: nine steps in ten only apply the kept preconditioner "
        "`G̃ (Ā + λI)⁻¹`, the tenth also collects the input statistics `x̃ᵀx̃` and refreshes the Cholesky "
        "inverse) against AdamW's and SGD's, interleaved, on the digits MLP and CNN of the convergence "
        "section; also FOOF in front of AdamW (`base=torch.optim.AdamW`) and FOOF with statistics on every "
        f"step. The target: FOOF's step at most {rules.STEP_LIMIT:g}× AdamW's. What the step buys in time to "
        "accuracy is in the convergence section."
    ),
    run=run,
    estimate=(2, 20),
)
