"""Section 3: the memory captured inputs hold at the peak of a step, and RSS across many steps."""

from __future__ import annotations

import copy
import gc
import statistics
from typing import Any

import torch
from torch import Tensor, nn

from inputaware_optim import InputAwareAdamW

from ..core import Config, Panel, Plot, Progress, Result, Section, Series, Table, Target
from ..machine import allocated_bytes, has_allocation_probe, resident_bytes
from ..models import GPT, Workload, workloads

VARIANTS = ("stock", "reference", "clone")
KIB, MIB = 1024, 1024 * 1024


def _optimizer(variant: str, model: nn.Module) -> torch.optim.Optimizer:
    if variant == "stock":
        return torch.optim.AdamW(model.parameters(), lr=1e-4)
    return InputAwareAdamW(model, lr=1e-4, storage="clone" if variant == "clone" else "reference")


def _measured_step(model: nn.Module, optimizer: torch.optim.Optimizer, workload: Workload) -> tuple[int, int]:
    """One step; the bytes allocated since its start, just before backward and just before step."""
    optimizer.zero_grad()
    start = allocated_bytes()
    loss = workload.loss(model, workload.batch)
    before_backward = allocated_bytes() - start
    loss.backward()
    del loss
    before_step = allocated_bytes() - start
    optimizer.step()
    return before_backward, before_step


def _captured_bytes(optimizer: InputAwareAdamW, model: nn.Module, workload: Workload) -> int:
    """The bytes of every distinct tensor storage the capture holds after one forward and backward."""
    optimizer.zero_grad()
    workload.loss(model, workload.batch).backward()
    storages: dict[int, int] = {}
    for call in optimizer.capture.calls():
        for value in (*call.args, *call.kwargs.values()):
            if isinstance(value, Tensor):
                storage = value.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    optimizer.zero_grad()
    return sum(storages.values())


def _peaks(workload: Workload, config: Config) -> dict[str, Any]:
    torch.manual_seed(config.seed)
    base = workload.build()
    models = {variant: copy.deepcopy(base) for variant in VARIANTS}
    optimizers = {variant: _optimizer(variant, models[variant]) for variant in VARIANTS}
    for variant in VARIANTS:  # optimizer state and first-call caches, before anything is measured
        for _ in range(2):
            _measured_step(models[variant], optimizers[variant], workload)
    samples: dict[str, list[tuple[int, int]]] = {variant: [] for variant in VARIANTS}
    # No collection mid-step: freeing unrelated garbage there would show up as a difference.
    gc.collect()
    gc.disable()
    try:
        for _ in range(config.pairs):
            for variant in VARIANTS:
                samples[variant].append(_measured_step(models[variant], optimizers[variant], workload))
    finally:
        gc.enable()
    clone = optimizers["clone"]
    assert isinstance(clone, InputAwareAdamW)
    out: dict[str, Any] = {
        "captured_input_bytes": _captured_bytes(clone, models["clone"], workload),
        "samples": samples,
    }
    for point, index in (("before_backward", 0), ("before_step", 1)):
        out[f"stock_{point}"] = statistics.median(s[index] for s in samples["stock"])
        for variant in ("reference", "clone"):
            extra = [ours[index] - stock[index] for ours, stock in zip(samples[variant], samples["stock"], strict=True)]
            out[f"{variant}_extra_{point}"] = statistics.median(extra)
    return out


def _resident_over_steps(config: Config, steps: int) -> dict[str, Any]:
    """Resident set and heap bytes every few steps of a small GPT, stock and input-aware in turn."""
    torch.manual_seed(config.seed)
    base = GPT(vocab=256, context=16, width=32, layers=2, heads=2)
    generator = torch.Generator().manual_seed(config.seed)
    tokens = torch.randint(0, 256, (4, 17), generator=generator)

    every = max(1, steps // 100)
    out: dict[str, Any] = {"every": every, "steps": steps}
    for variant in ("stock", "reference"):
        model = copy.deepcopy(base)
        optimizer = _optimizer(variant, model)
        resident, heap = [], []
        for step in range(steps):
            # A fresh batch tensor each step, as a data loader makes: a leak would keep them.
            batch = tokens.clone()
            optimizer.zero_grad()
            logits = model(batch[:, :-1])
            nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
            optimizer.step()
            if step % every == 0 or step == steps - 1:
                resident.append(resident_bytes())
                heap.append(allocated_bytes())
        out[variant] = {"resident_bytes": resident, "heap_bytes": heap}
    return out


def _since_start(label: str, steps: list[int], values: list[int], unit: int) -> Series:
    return Series(label, list(steps), [(v - values[0]) / unit for v in values])


def _growth(values: list[int]) -> int:
    """Growth after warm-up: median of the last tenth minus median of the second tenth of samples."""
    tenth = max(1, len(values) // 10)
    return int(statistics.median(values[-tenth:]) - statistics.median(values[tenth : 2 * tenth]))


def run(config: Config, progress: Progress) -> Result:
    if not has_allocation_probe():
        return Result(notes=["Skipped: measuring heap bytes needs glibc's mallinfo2 (Linux, glibc >= 2.33)."])
    models = workloads(config)
    progress.start(len(models) + 1)
    peaks: dict[str, Any] = {}
    rows = []
    for workload in models:
        progress.describe(workload.name)
        peak = _peaks(workload, config)
        peaks[workload.name] = peak
        rows.append(
            [
                workload.name,
                f"{peak['stock_before_backward'] / MIB:.2f}",
                f"{peak['reference_extra_before_backward'] / KIB:+.1f}",
                f"{peak['clone_extra_before_backward'] / KIB:+.1f}",
                f"{peak['captured_input_bytes'] / KIB:.1f}",
                f"{peak['stock_before_step'] / MIB:.2f}",
                f"{peak['reference_extra_before_step'] / KIB:+.1f}",
                f"{peak['clone_extra_before_step'] / KIB:+.1f}",
            ]
        )
        progress.advance()

    steps = config.pick(100, 1000, 1000)
    progress.describe(f"RSS over {steps} steps")
    resident = _resident_over_steps(config, steps)
    progress.advance()
    growth = {
        variant: {kind: _growth(resident[variant][kind]) for kind in ("resident_bytes", "heap_bytes")}
        for variant in ("stock", "reference")
    }
    resident["growth"] = growth

    worst_reference = max(
        peaks.values(), key=lambda p: p["reference_extra_before_backward"] / p["stock_before_backward"]
    )
    share = worst_reference["reference_extra_before_backward"] / worst_reference["stock_before_backward"]
    targets = [
        Target.at_most(
            "storage='reference': extra bytes at the step's peak (before backward)",
            100 * share,
            1.0,
            "% of the step's bytes",
            "worst of "
            + ", ".join(f"{n} {p['reference_extra_before_backward'] / KIB:+.1f} KiB" for n, p in peaks.items()),
            source="README claim (zero-copy)",
        ),
        Target.at_most(
            f"RSS growth over {steps} steps with capture",
            growth["reference"]["resident_bytes"] / MIB,
            1.0,
            "MiB",
            f"heap growth {growth['reference']['heap_bytes'] / KIB:+.1f} KiB; stock AdamW: RSS "
            f"{growth['stock']['resident_bytes'] / MIB:+.2f} MiB, heap {growth['stock']['heap_bytes'] / KIB:+.1f} KiB",
            source="issue 4 (flat)",
        ),
    ]
    table = Table(
        "Heap bytes allocated during a step (since zero_grad), stock AdamW vs InputAwareAdamW",
        [
            "model",
            "stock, before backward (MiB)",
            "reference: extra (KiB)",
            "clone: extra (KiB)",
            "captured inputs' size (KiB)",
            "stock, before step (MiB)",
            "reference: extra (KiB)",
            "clone: extra (KiB)",
        ],
        rows,
        "Bytes from glibc's mallinfo2 (uordblks + hblkhd), medians over "
        f"{config.pairs} interleaved steps. Before backward, autograd holds every activation (the usual peak). "
        "Before step, autograd has freed them but the captures still hold the inputs until the step "
        "(that is what a rule reads).",
    )
    x: list[int] = [i * resident["every"] for i in range(len(resident["stock"]["resident_bytes"]))]
    x[-1] = steps - 1
    plot = Plot(
        "rss",
        f"Memory across {steps} training steps of a small GPT",
        [
            Panel(
                "resident set size, change since the first step",
                "step",
                "MiB",
                [_since_start(v, x, resident[v]["resident_bytes"], MIB) for v in ("stock", "reference")],
            ),
            Panel(
                "heap bytes allocated, change since the first step",
                "step",
                "KiB",
                [_since_start(v, x, resident[v]["heap_bytes"], KIB) for v in ("stock", "reference")],
            ),
        ],
    )
    return Result(tables=[table], targets=targets, plots=[plot], data={"peaks": peaks, "resident": resident})


SECTION = Section(
    name="memory",
    title="Memory held by captured inputs",
    summary=(
        "Three copies of each model train in turn: stock `torch.optim.AdamW`, and `InputAwareAdamW` "
        'with `storage="reference"` (the default: a reference to what autograd saves anyway) and '
        '`storage="clone"` (private copies). The C heap\'s allocated bytes (glibc `mallinfo2`), '
        "measured from `zero_grad` to just before backward and to just before step, give the extra "
        "bytes each variant holds. Then the resident set over many steps, which must stay flat."
    ),
    run=run,
)
