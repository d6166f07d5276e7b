"""Section 8: K-FAC's and Eva's training steps against AdamW's on digits, on the convergence section's schedule."""

from __future__ import annotations

from .. import rules
from ..core import Config, Progress, Result, Section, Table
from ..digits import BATCH

KFAC = "K-FAC"
EVA = "Eva"
ALONE = "K-FAC's arithmetic alone"


def run(config: Config, progress: Progress) -> Result:
    every = rules.STATISTICS_EVERY
    timed = {
        KFAC: (rules.kfac(), every),
        EVA: (rules.eva(), every),
        f"K-FAC (statistics every step, inverses every {every})": (
            rules.kfac(statistics_every=1, update_every=every),
            every,
        ),
        "Eva (statistics every step)": (rules.eva(statistics_every=1), 1),
        ALONE: (rules.kernel_floor(two_sided=True), every),
    }
    progress.start(4)
    measured = rules.step_times(config, progress, timed, large=(KFAC, EVA))
    targets = []
    for model, by_batch in measured.ratios.items():
        targets.append(rules.step_target(KFAC, model, by_batch[BATCH][KFAC], config, floor=by_batch[BATCH][ALONE]))
        targets.append(
            rules.step_target(
                EVA, model, by_batch[BATCH][EVA], config, informational=True, schedule=f"statistics every {every} steps"
            )
        )
    table = Table(
        "Training step time (zero_grad, forward, backward, step) on digits, ratio vs AdamW",
        ["model", "batch", "optimizer", "step time", "ratio vs AdamW"],
        measured.rows,
        f"{KFAC} and {EVA}: {rules.SCHEDULE} (Eva has no inverse: its statistics every {every} steps), as trained "
        "in the convergence section; the rows with statistics on every step are for comparison. K-FAC's statistics "
        "step adds, per layer, both factors' sums (x̃x̃ᵀ from the inputs, ggᵀ from the output gradients) and two "
        "Cholesky inverses; every step applies the two-sided product (Ḡ + √λI)⁻¹ G̃ (Ā + √λI)⁻¹. Eva's "
        f"statistics are two mean vectors, its inverses closed-form. {ALONE}: SGD with momentum plus K-FAC's "
        f"two-sided products every step and, every {every} steps, its statistics products (x̃ᵀx̃, ggᵀ, averaged "
        "into the running moments) and Cholesky "
        "inverses, called directly, with no capture and no library code: the least K-FAC's step can take here. "
        f"{rules.STEP_TABLE_NOTE} K-FAC damping λ = {rules.KFAC_DAMPING:g}, Eva damping {rules.EVA_DAMPING:g}.",
    )
    data = {"batch": BATCH, "schedule": rules.SCHEDULE, "models": measured.data}
    return Result(tables=[table], targets=targets, data=data)


SECTION = Section(
    name="kfac",
    title="K-FAC and Eva: training step time on digits",
    summary=(
        f"`KFAC(model, lr, momentum=0.9, damping=0.1, update_every=1, statistics_every=10)` and "
        f"`Eva(model, lr, statistics_every=10, kl_clip=None)` ({rules.SCHEDULE}) against AdamW's and SGD's "
        "training step, interleaved, on the digits MLP and CNN of the convergence section, beside the same "
        f"rules with statistics on every step. The target: K-FAC's step at most {rules.STEP_LIMIT:g}× AdamW's "
        "(Eva's against the same bar, informational). What the step buys in time to accuracy is in the "
        "convergence section."
    ),
    run=run,
    estimate=(1, 25),
)
