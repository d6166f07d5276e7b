"""Section 9: DP-SGD against Opacus: the same noise-free update, step time and memory."""

from __future__ import annotations

import copy
import gc
import statistics
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inputaware_optim import DPSGD

from ..core import Config, Panel, Plot, Progress, Result, Section, Series, Table, Target, format_seconds
from ..machine import allocated_bytes, has_allocation_probe, profiled
from ..models import Workload, training_step, workloads
from ..timing import Ratio, Timing, interleave

SGD, OURS, OPACUS, GHOST = "SGD (no privacy)", "DPSGD", "Opacus", "Opacus ghost"
VARIANTS = (SGD, OURS, OPACUS, GHOST)
# Plain SGD's step followed by the draw of the Gaussian noise of every parameter (torch.randn into a
# kept buffer, with a CPU generator, as DPSGD draws it): no DP-SGD can take less on this machine.
NOISE_FLOOR = "SGD + noise draw"
EQUALITY_STEPS, EQUALITY_LR = 5, 0.1
TIMING_LR, NOISE_MULTIPLIER = 1e-3, 1.0
TOLERANCE = 1e-5
MIB = 1024 * 1024
# DPSGD's training step against plain SGD's, at most (Book-Keeping clips at about 1.03× the non-private
# step; here the noise alone, one Gaussian draw per parameter, is a sizable share of a small model's step).
STEP_VS_SGD = {"MLP": 1.5, "CNN": 2.0, "sequence": 2.0}


class SequenceModel(nn.Module):
    """Tokens → ``Embedding`` → a pre-norm residual MLP block on every position → mean → ``Linear`` head.

    Its ``nn.Linear`` layers see ``(batch, time, features)`` inputs, where DPSGD uses the ghost norm
    (never forming a per-sample gradient); its ``LayerNorm`` takes DPSGD's closed form.
    """

    def __init__(self, vocabulary: int, width: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.norm = nn.LayerNorm(width)
        self.expand = nn.Linear(width, 4 * width)
        self.contract = nn.Linear(4 * width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        h = h + self.contract(F.gelu(self.expand(self.norm(h))))
        return self.head(h.mean(1))


def _classification_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _workloads(config: Config) -> list[Workload]:
    """The MLP and CNN of sections 2 and 3, and a small sequence model."""
    generator = torch.Generator().manual_seed(config.seed)
    batch, length, width, vocabulary = config.pick(4, 32), config.pick(8, 32), config.pick(32, 128), 512
    sequence = Workload(
        "sequence",
        f"Embedding({vocabulary}, {width}), LayerNorm, Linear {width}-{4 * width}-{width} (GELU, residual) on "
        f"each of {length} positions, mean, Linear-10; batch {batch}",
        lambda: SequenceModel(vocabulary, width, 10),
        (
            torch.randint(0, vocabulary, (batch, length), generator=generator),
            torch.randint(0, 10, (batch,), generator=generator),
        ),
        _classification_loss,
    )
    return [*(w for w in workloads(config) if w.name in ("MLP", "CNN")), sequence]


def _with_batch(workload: Workload, batch: int, seed: int) -> Workload:
    """``workload`` on a fresh random batch of ``batch`` samples shaped like its own."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn((batch, *workload.batch[0].shape[1:]), generator=generator)
    labels = torch.randint(0, 10, (batch,), generator=generator)
    return Workload(workload.name, f"{workload.name}, batch {batch}", workload.build, (inputs, labels), workload.loss)


def _batch_size(workload: Workload) -> int:
    return int(workload.batch[1].shape[0])


def _opacus(
    model: nn.Module, lr: float, clip: float, noise: float, batch: int, seed: int
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Opacus's DP-SGD on ``model``: a ``GradSampleModule`` and a ``DPOptimizer`` around SGD."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    wrapped = GradSampleModule(model, loss_reduction="mean")
    optimizer = DPOptimizer(
        torch.optim.SGD(wrapped.parameters(), lr=lr),
        noise_multiplier=noise,
        max_grad_norm=clip,
        expected_batch_size=batch,
        loss_reduction="mean",
        generator=torch.Generator().manual_seed(seed),
    )
    return wrapped, optimizer


def _opacus_ghost(
    model: nn.Module, workload: Workload, lr: float, clip: float, noise: float, seed: int
) -> tuple[nn.Module, torch.optim.Optimizer, Workload]:
    """Opacus's ghost clipping (``grad_sample_mode="ghost"``), and ``workload`` with its loss for it.

    Opacus's fastest mode: per-sample gradient norms without per-sample gradients, then a second
    backward pass of the loss reweighted by each sample's clipping factor. It needs the loss per
    sample, so its workload's loss is cross-entropy through Opacus's ``DPLossFastGradientClipping``.
    """
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    wrapped = GradSampleModuleFastGradientClipping(
        model, loss_reduction="mean", max_grad_norm=clip, use_ghost_clipping=True
    )
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(wrapped.parameters(), lr=lr),
        noise_multiplier=noise,
        max_grad_norm=clip,
        expected_batch_size=_batch_size(workload),
        loss_reduction="mean",
        generator=torch.Generator().manual_seed(seed),
    )
    criterion = DPLossFastGradientClipping(wrapped, optimizer, nn.CrossEntropyLoss(), loss_reduction="mean")

    def loss(module: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        return criterion(module(batch[0]), batch[1])  # type: ignore[no-any-return]

    return wrapped, optimizer, Workload(workload.name, workload.description, workload.build, workload.batch, loss)


def _trio(
    workload: Workload, lr: float, clip: float, noise: float, seed: int, dtype: torch.dtype = torch.float32
) -> dict[str, tuple[nn.Module, torch.optim.Optimizer, Workload]]:
    """Plain SGD, DPSGD, Opacus and Opacus's ghost clipping, each on its own copy of the same model.

    Each comes with the workload its training step runs (the same batch; the ghost mode's loss
    goes through Opacus's per-sample loss wrapper). Same clipping and noise for all the private ones.
    """
    torch.manual_seed(seed)
    base = workload.build().to(dtype)
    plain, ours, theirs, ghost = (copy.deepcopy(base) for _ in VARIANTS)
    return {
        SGD: (plain, torch.optim.SGD(plain.parameters(), lr=lr), workload),
        OURS: (
            ours,
            DPSGD(
                ours,
                lr=lr,
                max_grad_norm=clip,
                noise_multiplier=noise,
                generator=torch.Generator().manual_seed(seed),
            ),
            workload,
        ),
        OPACUS: (*_opacus(theirs, lr, clip, noise, _batch_size(workload), seed), workload),
        GHOST: _opacus_ghost(ghost, workload, lr, clip, noise, seed),
    }


def _cast(batch: tuple[Tensor, Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)  # type: ignore[return-value]


def _median_sample_norm(workload: Workload, seed: int) -> float:
    """The median over the batch of each sample's gradient norm at the initial weights (from Opacus)."""
    from opacus import GradSampleModule

    torch.manual_seed(seed)
    model = GradSampleModule(workload.build(), loss_reduction="mean")
    workload.loss(model, workload.batch).backward()
    squares = sum(p.grad_sample.flatten(1).pow(2).sum(1) for p in model.parameters())  # type: ignore[union-attr]
    return float(torch.as_tensor(squares).sqrt().median())


def _equality(workload: Workload, clip: float, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    """DPSGD, Opacus and its ghost mode with noise off, ``EQUALITY_STEPS`` steps from the same weights.

    How far DPSGD ends from Opacus's hooks mode, and (checking that the ghost mode is given the
    same clipping) how far the ghost mode ends from it.
    """
    casted = Workload(workload.name, workload.description, workload.build, _cast(workload.batch, dtype), workload.loss)
    trio = _trio(casted, EQUALITY_LR, clip, 0.0, seed, dtype)
    start = [p.detach().clone() for p in trio[OPACUS][0].parameters()]
    for _ in range(EQUALITY_STEPS):
        for name in (OURS, OPACUS, GHOST):
            training_step(*trio[name])()
    ours, theirs, ghost = ([p.detach() for p in trio[name][0].parameters()] for name in (OURS, OPACUS, GHOST))
    difference = max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))
    ghost_difference = max(float((a - b).abs().max()) for a, b in zip(ghost, theirs, strict=True))
    update = max(float((b - s).abs().max()) for b, s in zip(theirs, start, strict=True))
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "steps": EQUALITY_STEPS,
        "max_abs_difference": difference,
        "max_abs_update": update,
        "relative_difference": difference / update,
        "ghost_relative_difference": ghost_difference / update,
    }


def _heap_after_backward(model: nn.Module, optimizer: torch.optim.Optimizer, workload: Workload) -> int:
    """One step; the heap bytes allocated since ``zero_grad`` when backward is done, just before ``step``."""
    optimizer.zero_grad()
    start = allocated_bytes()
    loss = workload.loss(model, workload.batch)
    loss.backward()
    del loss
    after = allocated_bytes() - start
    optimizer.step()
    return after


def _peak_in_step(model: nn.Module, optimizer: torch.optim.Optimizer, workload: Workload) -> int | None:
    """The peak of torch's CPU allocations during forward, backward and step, above the state after ``zero_grad``.

    From the profiler's memory events (every allocation and free, in order); ``None`` if this
    release of torch does not expose them.
    """
    from torch.profiler import ProfilerActivity

    optimizer.zero_grad()
    with profiled(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        workload.loss(model, workload.batch).backward()
        optimizer.step()
    try:
        events = profiler.profiler.kineto_results.events()  # type: ignore[union-attr]
        memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
        level = peak = 0
        for event in memory:
            level += event.nbytes()
            peak = max(peak, level)
    except AttributeError:  # pragma: no cover - depends on the torch release
        return None
    return peak


def _measure(workload: Workload, clip: float, config: Config, memory_samples: int) -> dict[str, Any]:
    """Interleaved step times of the three, then their heap after backward and their peak during the step."""
    trio = _trio(workload, TIMING_LR, clip, NOISE_MULTIPLIER, config.seed)
    steps = {name: training_step(*variant) for name, variant in trio.items()}
    steps[NOISE_FLOOR] = _with_noise_draw(workload, config.seed)
    timing = interleave(steps, config)
    out: dict[str, Any] = {"batch": _batch_size(workload), "timing": timing}
    if has_allocation_probe():
        heap: dict[str, list[int]] = {name: [] for name in VARIANTS}
        gc.collect()
        gc.disable()  # no collection mid-step: freeing unrelated garbage there would show up as a difference
        try:
            for _ in range(memory_samples):
                for name, variant in trio.items():
                    heap[name].append(_heap_after_backward(*variant))
        finally:
            gc.enable()
        out["heap_after_backward"] = {name: int(statistics.median(v)) for name, v in heap.items()}
    out["peak_in_step"] = {name: _peak_in_step(*variant) for name, variant in trio.items()}
    parameters = sum(p.numel() for p in trio[SGD][0].parameters())
    out["parameters"] = parameters
    out["per_sample_gradient_bytes"] = out["batch"] * parameters * 4
    return out


def _with_noise_draw(workload: Workload, seed: int) -> Any:
    """Plain SGD's training step on its own copy of the model, then the noise of every parameter drawn."""
    torch.manual_seed(seed)
    model = workload.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=TIMING_LR)
    sgd_step = training_step(model, optimizer, workload)
    generator = torch.Generator().manual_seed(seed)
    buffers = [torch.empty_like(p) for p in model.parameters()]

    def step() -> None:
        sgd_step()
        for buffer in buffers:
            torch.randn(buffer.shape, generator=generator, out=buffer)

    return step


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.2f}"


def _ratios(timing: Timing) -> dict[str, Any]:
    return {
        "dpsgd_vs_opacus": timing.ratio(OURS, OPACUS),
        "dpsgd_vs_opacus_ghost": timing.ratio(OURS, GHOST),
        "dpsgd_vs_sgd": timing.ratio(OURS, SGD),
        "opacus_vs_sgd": timing.ratio(OPACUS, SGD),
        "opacus_ghost_vs_sgd": timing.ratio(GHOST, SGD),
        "noise_floor_vs_sgd": timing.ratio(NOISE_FLOOR, SGD),
    }


def _record(measured: dict[str, Any]) -> dict[str, Any]:
    timing: Timing = measured["timing"]
    return {
        **{k: v for k, v in measured.items() if k != "timing"},
        "seconds_per_step": {name: timing.per_call(name) for name in VARIANTS},
        "ratios": {key: ratio.__dict__ for key, ratio in _ratios(timing).items()},
        "timing": timing.to_json(),
    }


def run(config: Config, progress: Progress) -> Result:
    with warnings.catch_warnings():
        # Opacus's full backward hooks fire on the first layer, whose input needs no gradient; PyTorch warns.
        warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
        warnings.filterwarnings("ignore", message=".*[Ss]ecure RNG", category=UserWarning)
        return _run(config, progress)


def _run(config: Config, progress: Progress) -> Result:
    models = _workloads(config)
    mlp = models[0]
    sweep = sorted({*config.pick((4, 16), (16, 64, 256), (16, 64, 256, 1024)), _batch_size(mlp)})
    progress.start(2 * len(models) + len(sweep) - 1)
    equality_rows, timing_rows, memory_rows = [], [], []
    data: dict[str, Any] = {"workloads": {}, "mlp_batch_sweep": {}}
    worst: dict[str, float] = {}
    clips: dict[str, float] = {}
    step_ratios: dict[str, dict[str, Ratio]] = {}
    for workload in models:
        progress.describe(f"{workload.name} noise-free updates")
        clip = _median_sample_norm(workload, config.seed)
        clips[workload.name] = clip
        equal = [_equality(workload, clip, dtype, config.seed) for dtype in (torch.float32, torch.float64)]
        for result in equal:
            worst[result["dtype"]] = max(worst.get(result["dtype"], 0.0), result["relative_difference"])
            equality_rows.append(
                [
                    workload.name,
                    result["dtype"],
                    f"{clip:.3g}",
                    f"{result['max_abs_difference']:.3g}",
                    f"{result['max_abs_update']:.3g}",
                    f"{result['relative_difference']:.3g}",
                    f"{result['ghost_relative_difference']:.3g}",
                ]
            )
        progress.advance()
        progress.describe(f"{workload.name} step times and memory")
        measured = _measure(workload, clip, config, memory_samples=min(config.pairs, 5))
        timing: Timing = measured["timing"]
        ratios = _ratios(timing)
        step_ratios[workload.name] = ratios
        timing_rows.append(
            [
                workload.name,
                *(format_seconds(timing.per_call(name)) for name in VARIANTS),
                ratios["dpsgd_vs_opacus"].shown(),
                ratios["dpsgd_vs_opacus_ghost"].shown(),
                ratios["dpsgd_vs_sgd"].shown(),
                ratios["opacus_vs_sgd"].shown(),
                ratios["opacus_ghost_vs_sgd"].shown(),
                ratios["noise_floor_vs_sgd"].shown(),
            ]
        )
        heap = measured.get("heap_after_backward", {})
        memory_rows.append(
            [
                workload.name,
                *(_mib(heap.get(name)) for name in VARIANTS),
                *(_mib(measured["peak_in_step"][name]) for name in VARIANTS),
                _mib(measured["per_sample_gradient_bytes"]),
                " / ".join(f"{timing.faults_per_call(name):.0f}" for name in VARIANTS),
            ]
        )
        data["workloads"][workload.name] = {
            "description": workload.description,
            "max_grad_norm": clip,
            "equality": equal,
            **_record(measured),
        }
        if workload is mlp:
            data["mlp_batch_sweep"][str(measured["batch"])] = data["workloads"][workload.name]
        progress.advance()
    for batch in sweep:
        if str(batch) in data["mlp_batch_sweep"]:
            continue
        progress.describe(f"MLP batch {batch}")
        resized = _with_batch(mlp, batch, config.seed)
        data["mlp_batch_sweep"][str(batch)] = _record(_measure(resized, clips[mlp.name], config, memory_samples=3))
        progress.advance()
    data["mlp_batch_sweep"] = {str(b): data["mlp_batch_sweep"][str(b)] for b in sweep}

    names = ", ".join(w.name for w in models)
    targets = [
        Target.at_most(
            "Noise-free DPSGD update vs Opacus's, float32: largest parameter difference relative to the update",
            worst["float32"],
            TOLERANCE,
            "",
            f"worst of {names} after {EQUALITY_STEPS} steps (lr {EQUALITY_LR:g}, max_grad_norm = the median "
            f"sample's gradient norm, so about half the samples are clipped); in float64 the worst is "
            f"{worst['float64']:.2g}, so the float32 gap is rounding. Informational: the two compute the same "
            "update, and the tolerance allows float32 rounding",
            source="informational",
        )
    ]
    for workload in models:
        ratios = step_ratios[workload.name]
        where = f"{workload.description}; median of interleaved rounds (range {ratios['dpsgd_vs_sgd'].shown()})"
        targets.append(
            Target.at_most(
                f"DPSGD training step vs plain SGD's, {workload.name}",
                ratios["dpsgd_vs_sgd"].median,
                STEP_VS_SGD[workload.name],
                "×",
                f"{where}. Both take zero_grad, forward, backward and step; DPSGD also clips per sample and "
                f"draws the noise (noise_multiplier {NOISE_MULTIPLIER:g}). Drawing the noise alone takes SGD to "
                f"{ratios['noise_floor_vs_sgd'].median:.2f}× (torch's CPU generator, one Gaussian per parameter): "
                "the floor of any DP-SGD here",
            ).full_size_only(config)
        )
        targets.append(
            Target.at_most(
                f"DPSGD training step vs Opacus ghost clipping's, {workload.name}",
                ratios["dpsgd_vs_opacus_ghost"].median,
                1.0,
                "×",
                f"{workload.description}; median of interleaved rounds (range "
                f"{ratios['dpsgd_vs_opacus_ghost'].shown()}). Opacus's fastest mode (grad_sample_mode='ghost'), "
                "the same clipping and noise",
                strict=True,
            ).full_size_only(config)
        )
        targets.append(
            Target.at_most(
                f"DPSGD training step vs Opacus hooks mode's, {workload.name}",
                ratios["dpsgd_vs_opacus"].median,
                1.0,
                "×",
                f"{workload.description}; median of interleaved rounds (range {ratios['dpsgd_vs_opacus'].shown()}). "
                "Opacus's GradSampleModule, which materializes every per-sample gradient",
                strict=True,
                source="informational",
            ).full_size_only(config)
        )
    tables = [
        Table(
            f"Noise-free updates: DPSGD, Opacus and Opacus ghost from the same weights, {EQUALITY_STEPS} steps of SGD "
            f"(lr {EQUALITY_LR:g}) on the same batch",
            [
                "model",
                "dtype",
                "max_grad_norm",
                "max |θ_DPSGD − θ_Opacus|",
                "max |θ − θ₀| (Opacus)",
                "difference / update",
                "Opacus ghost vs Opacus: difference / update",
            ],
            equality_rows,
            "max_grad_norm is the median of the per-sample gradient norms at the initial weights, so about half "
            "the samples are clipped at the first step. Opacus: GradSampleModule (loss_reduction='mean') and "
            "DPOptimizer around torch.optim.SGD with expected_batch_size = the batch size; Opacus ghost: the same "
            "clipping in grad_sample_mode='ghost', checked here to give the same update.",
        ),
        Table(
            "Training step (zero_grad, forward, backward, step), interleaved",
            [
                "model",
                *(f"{name} step" for name in VARIANTS),
                "DPSGD / Opacus",
                "DPSGD / Opacus ghost",
                "DPSGD / SGD",
                "Opacus / SGD",
                "Opacus ghost / SGD",
                "(SGD + noise draw) / SGD",
            ],
            timing_rows,
            "; ".join(f"{w.name}: {w.description}" for w in models)
            + f". lr {TIMING_LR:g}, noise_multiplier {NOISE_MULTIPLIER:g} (the noise is drawn in both), the same "
            "max_grad_norm as above. DPSGD computes per-sample norms from the captured inputs and output "
            "gradients (closed forms for Linear, Conv2d, LayerNorm and Embedding, the ghost norm for sequence "
            "inputs); Opacus (hooks mode) materializes every per-sample gradient; Opacus ghost "
            "(grad_sample_mode='ghost': GradSampleModuleFastGradientClipping, DPOptimizerFastGradientClipping and "
            "DPLossFastGradientClipping around cross-entropy) computes per-sample norms without them "
            "and runs a second backward pass of the loss reweighted by the clipping factors. (SGD + noise draw): "
            "plain SGD's step, then the Gaussian noise of every parameter drawn with torch's CPU generator, as "
            "DPSGD draws it: the least any DP-SGD step can take on this machine.",
        ),
        Table(
            "Memory: heap bytes after backward (before step) and peak during the step, MiB above the state "
            "after zero_grad",
            [
                "model",
                *(f"after backward: {name}" for name in VARIANTS),
                *(f"peak in step: {name}" for name in VARIANTS),
                "batch × parameters × 4 B",
                "page faults per step: " + " / ".join(VARIANTS),
            ],
            memory_rows,
            "After backward: glibc's mallinfo2 (uordblks + hblkhd), median over interleaved steps; Opacus holds "
            "every per-sample gradient there, DPSGD the captured inputs and output gradients; Opacus ghost's "
            "zero_grad zeroes the gradients in place instead of freeing them, so its parameter gradients are not "
            "counted there. Peak in step: the "
            "highest level of torch's CPU allocations from the profiler's memory events across forward, backward "
            "and step, which includes DPSGD's work inside step(). Page faults: the process's minor page faults per "
            "step during the timing above (median), memory malloc took from the kernel afresh and faulted in.",
        ),
    ]
    batches = [float(b) for b in data["mlp_batch_sweep"]]
    runs = list(data["mlp_batch_sweep"].values())

    def ratio_series(key: str, label: str) -> Series:
        return Series(label, batches, [r["ratios"][key]["median"] for r in runs], "o-")

    def memory_series(key: str) -> list[Series]:
        return [
            Series(
                name, batches, [None if r.get(key, {}).get(name) is None else r[key][name] / MIB for r in runs], "o-"
            )
            for name in VARIANTS
        ]

    plot = Plot(
        "mlp-batch",
        f"DP-SGD on the {mlp.description.split(',')[0]} as the batch grows: DPSGD vs Opacus",
        [
            Panel(
                "training step time relative to plain SGD",
                "batch",
                "× SGD's step",
                [
                    ratio_series("dpsgd_vs_sgd", "DPSGD / SGD"),
                    ratio_series("opacus_vs_sgd", "Opacus / SGD"),
                    ratio_series("opacus_ghost_vs_sgd", "Opacus ghost / SGD"),
                ],
            ),
            Panel("heap after backward", "batch", "MiB", memory_series("heap_after_backward")),
            Panel("peak during the step", "batch", "MiB", memory_series("peak_in_step")),
        ],
        columns=3,
        caption=(
            f"{SGD}: torch.optim.SGD; {OURS}: inputaware_optim.DPSGD (per-sample clipping from the captured "
            f"inputs and output gradients, then noise); {OPACUS}: Opacus's GradSampleModule (hooks mode) and "
            f"DPOptimizer around SGD; {GHOST}: Opacus's ghost clipping (grad_sample_mode='ghost', per-sample "
            "norms without per-sample gradients, two backward passes). DPSGD / SGD, Opacus / SGD and Opacus "
            "ghost / SGD: median interleaved training-step time ratios. Heap after backward: glibc's allocated "
            "bytes; peak during the step: the profiler's highest "
            "CPU allocation level across forward, backward and step."
        ),
    )
    data["max_grad_norm"] = clips
    data["worst_relative_difference"] = worst
    return Result(tables=tables, targets=targets, plots=[plot], data=data)


SECTION = Section(
    name="dp",
    title="DP-SGD against Opacus",
    summary=(
        "`inputaware_optim.DPSGD` against Opacus (`GradSampleModule` + `DPOptimizer` around `torch.optim.SGD`, "
        '`loss_reduction="mean"`, `expected_batch_size` = the batch size) and against Opacus\'s ghost clipping '
        '(`grad_sample_mode="ghost"`, its fastest mode) on the same model, batch and clipping bound: '
        "first with the noise off, the parameters after a few steps compared; then the "
        "training step of each, with plain `torch.optim.SGD` as the no-privacy reference, interleaved; then "
        "the memory each holds after backward and at its peak during the step. On the MLP and CNN of sections "
        "2 and 3 and a small sequence model whose `nn.Linear` layers see `(batch, time, features)` inputs; "
        "then the MLP across batch sizes. Privacy accounting is out of scope for both here."
    ),
    run=run,
    estimate=(5, 40),
)
