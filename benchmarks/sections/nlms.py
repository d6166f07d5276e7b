"""Section 5: NLMS against SGD and Adam, identifying an FIR system from badly scaled inputs."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from inputaware_optim import NLMS

from ..core import Config, Panel, Plot, Progress, Result, Section, Series, Table, format_seconds
from ..timing import interleave

TAPS = 16
NOISE = 1e-3  # measurement noise relative to the input's scale at each step


class _Scenario(NamedTuple):
    description: str
    scale: Tensor  # of the input signal, per sample
    systems: Tensor  # the unknown filter in force at each step, (steps, TAPS)


def _scenarios(steps: int, generator: torch.Generator) -> dict[str, _Scenario]:
    """Badly scaled inputs, with the unknown system fixed, or changing half-way through a quiet phase."""
    samples = steps + TAPS - 1
    first, second = (_unit(torch.randn(TAPS, generator=generator, dtype=torch.float64)) for _ in range(2))
    fixed = first.expand(steps, TAPS)
    period = steps // 3
    # The switch comes as the envelope turns quiet: only a rule that adapts at any scale tracks it at once.
    switch = period + period // 2
    changing = torch.cat([first.expand(switch, TAPS), second.expand(steps - switch, TAPS)])
    t = torch.arange(samples, dtype=torch.float64)
    return {
        "random": _Scenario(
            "each sample's scale drawn from 10^U(-3, 3), fixed system",
            10.0 ** (torch.rand(samples, generator=generator, dtype=torch.float64) * 6 - 3),
            fixed,
        ),
        "drifting": _Scenario(
            f"scale drifting between 10^-2 and 10^2 (period {period}), system changed at step {switch}",
            10.0 ** (2 * torch.sin(2 * math.pi * t / period)),
            changing,
        ),
    }


def _unit(x: Tensor) -> Tensor:
    return x / x.norm()


def _identify(
    make: Callable[[nn.Module], torch.optim.Optimizer], inputs: Tensor, desired: Tensor, systems: Tensor, record: int
) -> dict[str, Any]:
    """Online identification, one sample a step: the relative error ``|w - h_t| / |h_t|`` every ``record`` steps.

    The record ends early, with ``inf``, if the filter diverges.
    """
    filter_ = nn.Linear(TAPS, 1, bias=False).double()
    nn.init.zeros_(filter_.weight)
    optimizer = make(filter_)
    steps: list[int] = []
    errors: list[float] = []
    for t in range(inputs.shape[0]):
        optimizer.zero_grad()
        (0.5 * (filter_(inputs[t : t + 1]) - desired[t]) ** 2).sum().backward()
        optimizer.step()
        if t % record == 0 or t == inputs.shape[0] - 1:
            error = float((filter_.weight.detach().reshape(-1) - systems[t]).norm() / systems[t].norm())
            steps.append(t + 1)
            errors.append(error if math.isfinite(error) else math.inf)
            if not math.isfinite(error):
                break
    diverged = not math.isfinite(errors[-1])
    # The mean of log10 error over the whole run rewards converging (and re-converging) fast.
    mean_log = math.inf if diverged else sum(math.log10(max(e, 1e-300)) for e in errors) / len(errors)
    return {"step": steps, "error": errors, "diverged": diverged, "mean_log10_error": mean_log}


def _sgd(lr: float) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda model: torch.optim.SGD(model.parameters(), lr=lr)


def _adam(lr: float) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda model: torch.optim.Adam(model.parameters(), lr=lr)


def _nlms(lr: float) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda model: NLMS(model, lr=lr)


def run(config: Config, progress: Progress) -> Result:
    steps = config.pick(300, 3000, 6000)
    record = max(1, steps // 150)
    generator = torch.Generator().manual_seed(config.seed)
    sweeps = {
        "NLMS": [(lr, _nlms(lr)) for lr in config.pick((0.5,), (0.1, 0.5, 1.0))],
        "SGD": [(lr, _sgd(lr)) for lr in config.pick((1e-6, 1e-3), (1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1))],
        # Adam's per-coordinate scaling adapts to the input's scale too, though over its moments' horizon.
        "Adam": [(lr, _adam(lr)) for lr in config.pick((1e-2,), (1e-4, 1e-3, 1e-2, 1e-1))],
    }
    scenarios = _scenarios(steps, generator)
    progress.start(len(scenarios) * sum(len(v) for v in sweeps.values()) + 1)
    data: dict[str, Any] = {"taps": TAPS, "steps": steps, "record_every": record, "noise": NOISE, "scenarios": {}}
    rows, plots = [], []
    for scenario, (description, scale, systems) in scenarios.items():
        signal = torch.randn(scale.numel(), generator=generator, dtype=torch.float64) * scale
        inputs = signal.unfold(0, TAPS, 1).flip(1)  # row t: the last TAPS samples, newest first
        noise = torch.randn(steps, generator=generator, dtype=torch.float64) * NOISE * scale[TAPS - 1 :]
        desired = (inputs * systems).sum(1) + noise
        results: dict[str, list[dict[str, Any]]] = {}
        for name, sweep in sweeps.items():
            results[name] = []
            for lr, make in sweep:
                progress.describe(f"{scenario} {name} lr={lr:g}")
                results[name].append({"lr": lr, **_identify(make, inputs, desired, systems, record)})
                progress.advance()
        best = {name: min(runs, key=lambda r: r["mean_log10_error"]) for name, runs in results.items()}
        for name, chosen in best.items():
            reached = next((step for step, e in zip(chosen["step"], chosen["error"], strict=True) if e < 1e-2), None)
            rows.append(
                [
                    scenario,
                    name,
                    f"{chosen['lr']:g}",
                    "never" if reached is None else str(reached),
                    f"{10 ** chosen['mean_log10_error']:.2e}",
                    f"{chosen['error'][-1]:.2e}",
                    f"{sum(r['diverged'] for r in results[name])} of {len(results[name])}",
                ]
            )
        data["scenarios"][scenario] = {
            "description": description,
            "runs": results,
            "best_lr": {n: b["lr"] for n, b in best.items()},
        }
        panel_series = [Series(f"{name} lr={run['lr']:g}", run["step"], run["error"]) for name, run in best.items()]
        panel_series += [
            Series(f"SGD lr={run['lr']:g}", run["step"], run["error"], style=":")
            for run in results["SGD"]
            if run is not best["SGD"] and not run["diverged"]
        ]
        plots.append(
            Plot(
                f"identification-{scenario}",
                f"System identification ({TAPS} taps), {description}",
                [Panel("relative error of the identified filter", "step", "|w − h| / |h|", panel_series, logy=True)],
                columns=1,
                caption=(
                    "NLMS: normalized least mean squares (inputaware_optim.NLMS, each step divided by the input's "
                    "power); SGD: torch.optim.SGD without momentum; Adam: torch.optim.Adam with its defaults; lr: "
                    "the learning rate. Solid lines: each "
                    "optimizer's best learning rate by geometric-mean error; dotted: SGD's other learning rates "
                    "that did not diverge. w: the identified filter; h: the unknown system in force at that step."
                ),
            )
        )
    progress.describe("step time")
    timing_row, timing = _step_time(config)
    progress.advance()
    data["step_timing"] = timing
    tables = [
        Table(
            f"Relative filter error |w − h| / |h| over {steps} online steps (batch 1, float64), best learning rate "
            "of each sweep by the run's geometric-mean error",
            [
                "inputs",
                "optimizer",
                "best lr",
                "first step below 1e-2",
                "geometric-mean error",
                "final error",
                "learning rates that diverged",
            ],
            rows,
            f"Noise of relative size {NOISE:g} is added to the desired signal, so the error floor is near it. "
            "Learning rates swept: "
            + "; ".join(f"{name} {', '.join(f'{lr:g}' for lr, _ in sweep)}" for name, sweep in sweeps.items())
            + ".",
        ),
        Table(
            "NLMS step time vs torch.optim.SGD and torch.optim.Adam (training step of the filter, batch 1)",
            ["", "SGD step", "NLMS / SGD", "Adam / SGD", "NLMS / Adam"],
            [timing_row],
        ),
    ]
    return Result(tables=tables, plots=plots, data=data)


def _step_time(config: Config) -> tuple[list[str], dict[str, Any]]:
    torch.manual_seed(config.seed)
    x, desired = torch.randn(1, TAPS, dtype=torch.float64), torch.randn(1, 1, dtype=torch.float64)

    def step_of(make: Callable[[nn.Module], torch.optim.Optimizer]) -> Callable[[], None]:
        model = nn.Linear(TAPS, 1, bias=False).double()
        optimizer = make(model)

        def step() -> None:
            optimizer.zero_grad()
            (0.5 * (model(x) - desired) ** 2).sum().backward()
            optimizer.step()

        return step

    timing = interleave(
        {"SGD": step_of(_sgd(1e-3)), "NLMS": step_of(_nlms(1e-3)), "Adam": step_of(_adam(1e-3))}, config
    )
    ratios = {
        "NLMS / SGD": timing.ratio("NLMS", "SGD"),
        "Adam / SGD": timing.ratio("Adam", "SGD"),
        "NLMS / Adam": timing.ratio("NLMS", "Adam"),
    }
    row = ["training step", format_seconds(timing.per_call("SGD")), *(r.shown() for r in ratios.values())]
    return row, {
        "ratio": ratios["NLMS / SGD"].__dict__,
        "ratios": {name: r.__dict__ for name, r in ratios.items()},
        **timing.to_json(),
    }


SECTION = Section(
    name="nlms",
    title="NLMS vs SGD and Adam: system identification with badly scaled inputs",
    summary=(
        f"An unknown {TAPS}-tap FIR filter is identified online from a tapped delay line of its input, "
        "whose scale spans orders of magnitude: random per sample, or drifting slowly while the unknown "
        "system changes half-way, as the inputs turn quiet (tracking). NLMS divides each step by the input "
        "power, so one learning rate fits every scale; SGD must take a step small enough for the loudest "
        "inputs, and then barely moves on the quiet ones; Adam scales each coordinate by its gradient's running "
        "magnitude, which follows the input's scale only over its moments' horizon. Each optimizer gets a "
        "learning-rate sweep; the "
        "run with the lowest geometric-mean error is shown."
    ),
    run=run,
    estimate=(1, 15),
)
