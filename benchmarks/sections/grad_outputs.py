"""Section 7: what capturing output gradients costs, per hooked call and per training step."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from inputaware_optim import Capture, InputAwareAdamW

from ..core import Config, Progress, Result, Section, Table, Target, format_seconds
from ..models import Workload, training_step, workloads
from ..timing import Ratio, Timing, interleave

CALLS = 100  # forward + backward calls per timed function call, so the function call itself is negligible
PLAIN, INPUTS, GRAD_OUTPUTS, FULL_HOOK, TENSOR_HOOK = (
    "no capture",
    "Capture(model)",
    "Capture(model, grad_outputs=True)",
    "empty register_full_backward_hook",
    "empty forward hook + empty tensor hook on the output",
)
DESCRIPTIONS = {
    PLAIN: "the plain nn.Linear",
    INPUTS: "a forward hook recording the input (what every input-aware optimizer installs)",
    GRAD_OUTPUTS: "that hook also puts a tensor hook on the output, which files the gradient with the call",
    FULL_HOOK: "PyTorch's module backward hook, with nothing in it (what Opacus uses)",
    TENSOR_HOOK: "the mechanism capture uses, with nothing in it: PyTorch's price for it",
}
STOCK, OURS, OURS_GRAD_OUTPUTS = (
    "AdamW",
    "InputAwareAdamW",
    "InputAwareAdamW(grad_outputs=True)",
)


def _forward_backward(
    module: nn.Module, x: Tensor, grad: Tensor, after: Callable[[], None] | None
) -> Callable[[], None]:
    def call() -> None:
        for _ in range(CALLS):
            module(x).backward(grad)
        if after is not None:  # captured calls pile up until a step; dropping them is part of the cost
            after()

    return call


def _empty_tensor_hook(module: nn.Module, args: Any, output: Tensor) -> None:
    output.register_hook(lambda grad: None)


def _per_call(config: Config) -> tuple[Timing, int, int]:
    """Forward + backward of one ``nn.Linear``, plain and with each kind of hook, interleaved."""
    torch.manual_seed(config.seed)
    width, batch = config.pick(32, 128), config.pick(4, 32)
    plain = nn.Linear(width, width)
    # Each Linear sits in a model, as in training, and is called directly: only its own hook runs
    # (not the root model's bookkeeping hooks, which run once per forward of the whole model).
    models = {name: nn.Sequential(copy.deepcopy(plain)) for name in (INPUTS, GRAD_OUTPUTS, FULL_HOOK, TENSOR_HOOK)}
    modules = {name: model[0] for name, model in models.items()}
    inputs, grad_outputs = Capture(models[INPUTS]), Capture(models[GRAD_OUTPUTS], grad_outputs=True)
    modules[FULL_HOOK].register_full_backward_hook(lambda module, grad_input, grad_output: None)
    modules[TENSOR_HOOK].register_forward_hook(_empty_tensor_hook)
    # The input requires grad, as a hidden layer's does (a full backward hook also warns without it).
    x = torch.randn(batch, width, requires_grad=True)
    grad = torch.randn(batch, width)
    variants = {
        PLAIN: _forward_backward(plain, x, grad, None),
        INPUTS: _forward_backward(modules[INPUTS], x, grad, inputs.clear),
        GRAD_OUTPUTS: _forward_backward(modules[GRAD_OUTPUTS], x, grad, grad_outputs.clear),
        FULL_HOOK: _forward_backward(modules[FULL_HOOK], x, grad, None),
        TENSOR_HOOK: _forward_backward(modules[TENSOR_HOOK], x, grad, None),
    }
    return interleave(variants, config), width, batch


def _in_place_check() -> dict[str, Any]:
    """Whether ``Linear`` then ``ReLU(inplace=True)`` trains with each way of getting the output gradient."""
    outcome: dict[str, Any] = {}
    for name in (GRAD_OUTPUTS, FULL_HOOK):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
        capture = Capture(model, grad_outputs=True) if name == GRAD_OUTPUTS else None
        if capture is None:
            model[0].register_full_backward_hook(lambda module, grad_input, grad_output: None)
        try:
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        except RuntimeError as error:
            outcome[name] = {"works": False, "error": str(error).split(". ")[0] + "."}
        else:
            works = capture is None or capture.calls()[0].grad_output is not None
            outcome[name] = {"works": works, "error": None}
    return outcome


def _end_to_end(workload: Workload, config: Config) -> tuple[Timing, int, int]:
    """A training step with stock AdamW, InputAwareAdamW, and InputAwareAdamW capturing output gradients.

    Returns the timing, the number of hooked modules and the bytes of output gradients held until the step.
    """
    torch.manual_seed(config.seed)
    base = workload.build()
    models = {name: copy.deepcopy(base) for name in (STOCK, OURS, OURS_GRAD_OUTPUTS)}
    optimizers: dict[str, torch.optim.Optimizer] = {
        STOCK: torch.optim.AdamW(models[STOCK].parameters(), lr=1e-4),
        OURS: InputAwareAdamW(models[OURS], lr=1e-4),
        OURS_GRAD_OUTPUTS: InputAwareAdamW(models[OURS_GRAD_OUTPUTS], lr=1e-4, grad_outputs=True),
    }
    timing = interleave({name: training_step(models[name], optimizers[name], workload) for name in models}, config)
    ours = optimizers[OURS_GRAD_OUTPUTS]
    assert isinstance(ours, InputAwareAdamW)
    ours.zero_grad()
    workload.loss(models[OURS_GRAD_OUTPUTS], workload.batch).backward()
    storages = {
        grad.untyped_storage().data_ptr(): grad.untyped_storage().nbytes()
        for call in ours.capture.calls()
        for grad in call.grad_outputs or ()
        if grad is not None
    }
    ours.zero_grad()
    return timing, len(ours.capture.modules), sum(storages.values())


def _microseconds(ratio: Ratio) -> dict[str, Any]:
    """A per-round difference in seconds per ``CALLS`` calls, as microseconds per call."""
    scale = 1e6 / CALLS
    return {
        "median": ratio.median * scale,
        "low": ratio.low * scale,
        "high": ratio.high * scale,
        "rounds": [r * scale for r in ratio.rounds],
    }


def run(config: Config, progress: Progress) -> Result:
    models = [w for w in workloads(config) if w.name in ("MLP", "GPT")]
    progress.start(2 + len(models))
    progress.describe("nn.Linear forward + backward")
    timing, width, batch = _per_call(config)
    progress.advance()
    added = {name: _microseconds(timing.difference(name, PLAIN)) for name in timing.seconds}
    beyond_inputs = _microseconds(timing.difference(GRAD_OUTPUTS, INPUTS))
    # Per round: what the whole capture with output gradients adds, over what an empty full backward hook adds.
    versus_full = Ratio.of(
        [
            (ours - plain) / (full - plain)
            for ours, full, plain in zip(
                timing.seconds[GRAD_OUTPUTS], timing.seconds[FULL_HOOK], timing.seconds[PLAIN], strict=True
            )
        ]
    )
    per_call_rows = [
        [
            name,
            DESCRIPTIONS[name],
            f"{timing.per_call(name) / CALLS * 1e6:.2f}",
            f"{added[name]['median']:+.2f} ({added[name]['low']:+.2f} to {added[name]['high']:+.2f})",
            timing.ratio(name, PLAIN).shown(),
        ]
        for name in timing.seconds
    ]
    progress.describe("ReLU(inplace=True) after the module")
    in_place = _in_place_check()
    progress.advance()

    end_to_end: dict[str, Any] = {}
    end_rows = []
    for workload in models:
        progress.describe(f"{workload.name} training step")
        step_timing, hooked, held = _end_to_end(workload, config)
        ratios = {name: step_timing.ratio(name, STOCK) for name in (OURS, OURS_GRAD_OUTPUTS)}
        on_off = step_timing.ratio(OURS_GRAD_OUTPUTS, OURS)
        extra = step_timing.difference(OURS_GRAD_OUTPUTS, OURS)
        end_to_end[workload.name] = {
            "description": workload.description,
            "hooked_modules": hooked,
            "grad_output_bytes_held": held,
            "page_faults_per_step": {name: step_timing.faults_per_call(name) for name in step_timing.seconds},
            "stock_seconds": step_timing.per_call(STOCK),
            "ratio_vs_adamw": {name: ratio.__dict__ for name, ratio in ratios.items()},
            "grad_outputs_on_vs_off": on_off.__dict__,
            "grad_outputs_added_seconds": extra.median,
            "timing": step_timing.to_json(),
        }
        end_rows.append(
            [
                workload.name,
                str(hooked),
                format_seconds(step_timing.per_call(STOCK)),
                ratios[OURS].shown(),
                ratios[OURS_GRAD_OUTPUTS].shown(),
                on_off.shown(),
                f"{extra.median * 1e6 / hooked:+.2f}",
                f"{held / 1024:.0f}",
                " → ".join(f"{step_timing.faults_per_call(name):.0f}" for name in step_timing.seconds),
            ]
        )
        progress.advance()

    targets = [
        Target.at_most(
            "Output-gradient capture: µs added per hooked nn.Linear call (forward + backward) beyond input capture",
            beyond_inputs["median"],
            5.0,
            "µs",
            f"the bar is a tensor hook's price, a few µs per call; pairs {beyond_inputs['low']:+.2f} to "
            f"{beyond_inputs['high']:+.2f} µs; Linear {width}→{width}, batch {batch}",
        ).full_size_only(config),
        Target.at_most(
            "Capture with output gradients, added per call, relative to an empty full backward hook's",
            versus_full.median,
            1.0,
            "×",
            f"capture adds {added[GRAD_OUTPUTS]['median']:.2f} µs, "
            f"the empty full backward hook {added[FULL_HOOK]['median']:.2f} µs; pairs "
            f"{versus_full.low:.2f}–{versus_full.high:.2f}×",
            strict=True,
        ).full_size_only(config),
    ]
    in_place_rows = [
        [name, "yes" if result["works"] else "no", result["error"] or ""] for name, result in in_place.items()
    ]
    tables = [
        Table(
            f"Forward + backward of one nn.Linear ({width}→{width}, batch {batch}), by way of getting its "
            "output gradient",
            ["hooks", "what they do", "µs per call", "added (µs per call)", "ratio vs no capture"],
            per_call_rows,
            f"Each timed call makes {CALLS} forward + backward calls (the input requires grad, as a hidden "
            "layer's does); the capturing variants also drop their captures after them, as a step does. "
            f"Output gradients beyond input capture: {beyond_inputs['median']:+.2f} µs per call "
            f"({beyond_inputs['low']:+.2f} to {beyond_inputs['high']:+.2f}).",
        ),
        Table(
            "nn.Linear followed by nn.ReLU(inplace=True): does forward + backward run?",
            ["hooks", "runs", "error"],
            in_place_rows,
            "A full backward hook wraps the module's output in a view made by a custom autograd Function, "
            "which an in-place operation may not modify; the tensor hook leaves the output as it is.",
        ),
        Table(
            "Training step (zero_grad, forward, backward, step): capturing output gradients vs not, and vs AdamW",
            [
                "model",
                "hooked modules",
                "AdamW step",
                "InputAwareAdamW / AdamW",
                "with output gradients / AdamW",
                "output gradients on / off",
                "added per hooked module (µs)",
                "output gradients held until step (KiB)",
                "page faults per step: AdamW → InputAwareAdamW → with output gradients",
            ],
            end_rows,
            "; ".join(f"{w.name}: {w.description}" for w in models)
            + ". Three copies of each model with the same weights, stepped in turn; lr 1e-4, default flags. "
            "No rule reads the output gradients here: this is the cost of recording them. Recorded gradients live "
            "until step() instead of being freed during backward; the page faults (the process's minor faults per "
            "step, median) show when that makes malloc take memory from the kernel afresh each step.",
        ),
    ]
    data = {
        "linear": {"width": width, "batch": batch, "calls_per_sample": CALLS},
        "per_call_us": {name: timing.per_call(name) / CALLS * 1e6 for name in timing.seconds},
        "added_us_per_call": added,
        "grad_outputs_beyond_inputs_us": beyond_inputs,
        "capture_vs_full_backward_hook": versus_full.__dict__,
        "timing": timing.to_json(),
        "in_place_relu": in_place,
        "end_to_end": end_to_end,
    }
    return Result(tables=tables, targets=targets, data=data)


SECTION = Section(
    name="grad_outputs",
    title="Output-gradient capture: cost per call and per step",
    summary=(
        "Rules such as K-FAC and DP-SGD also need the gradient that reached each module's output. Capture "
        "gets it with a tensor hook put on the output by the forward hook it already has "
        "(`Capture(model, grad_outputs=True)`, or `grad_outputs=True` on an optimizer). Measured: the "
        "time one `nn.Linear` forward + backward takes with no capture, with input capture, with output "
        "gradients too, and with PyTorch's `register_full_backward_hook` (empty) instead, all interleaved; "
        "whether each survives an in-place activation after the module; and a full training step of the "
        "MLP and the small GPT with `InputAwareAdamW` capturing output gradients or not, against "
        "`torch.optim.AdamW`."
    ),
    run=run,
    estimate=(1, 11),
)
