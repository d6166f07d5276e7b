"""Section 1: what one forward hook costs per module call, and that un-owned modules pay nothing."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from inputaware_optim import InputAwareAdamW

from ..core import Config, Progress, Result, Section, Table, Target
from ..timing import interleave

CALLS = 100  # module calls per timed function call, so the Python call of the function itself is negligible


def _repeat(module: nn.Module, x: Tensor, after: Callable[[], None] | None = None) -> Callable[[], None]:
    def call() -> None:
        for _ in range(CALLS):
            module(x)
        if after is not None:
            after()

    return call


def _no_grad(call: Callable[[], None]) -> Callable[[], None]:
    def wrapped() -> None:
        with torch.no_grad():
            call()

    return wrapped


def run(config: Config, progress: Progress) -> Result:
    # A microsecond-scale difference is measured on a small, cheap layer (so the pair-to-pair
    # noise of the call itself stays small in absolute terms) and over more rounds than usual.
    config = dataclasses.replace(config, pairs=config.pick(config.pairs, max(config.pairs, 31)))
    torch.manual_seed(config.seed)
    width, batch = config.pick(32, 32), config.pick(4, 8)
    plain = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    hooked = copy.deepcopy(plain)
    optimizer = InputAwareAdamW(hooked, lr=1e-3)
    # Captured calls pile up until a step; dropping them is part of what capture costs.
    release = optimizer.capture.clear
    # PyTorch's own price for a module with any forward hook (its slower call path), for reference.
    empty_hook = copy.deepcopy(plain[0])
    empty_hook.register_forward_hook(lambda module, args, kwargs, output: None, with_kwargs=True)
    x = torch.randn(batch, width)
    hidden = plain[0](x).detach()

    cases = [
        ("Linear (owned by the optimizer: hooked)", "Linear", _repeat(plain[0], x), _repeat(hooked[0], x, release)),
        (
            "Linear with an empty forward hook (PyTorch's cost of any hook, for reference)",
            "Linear empty hook",
            _repeat(plain[0], x),
            _repeat(empty_hook, x),
        ),
        ("ReLU (un-owned: no hook)", "ReLU", _repeat(plain[1], hidden), _repeat(hooked[1], hidden)),
        (
            "Linear under torch.no_grad() (hook returns early)",
            "Linear no_grad",
            _no_grad(_repeat(plain[0], x)),
            _no_grad(_repeat(hooked[0], x, release)),
        ),
        (
            "whole model: Linear, ReLU, Linear (2 hooked + root hooks)",
            "model",
            _repeat(plain, x),
            _repeat(hooked, x, release),
        ),
    ]
    progress.start(len(cases))
    rows: list[list[str]] = []
    data: dict[str, Any] = {}
    for label, key, stock_call, hooked_call in cases:
        progress.describe(key)
        timing = interleave({"plain": stock_call, "hooked": hooked_call}, config)
        ratio = timing.ratio("hooked", "plain")
        added = timing.difference("hooked", "plain")
        plain_us = timing.per_call("plain") / CALLS * 1e6
        added_us = [d / CALLS * 1e6 for d in added.rounds]
        added_us_median = added.median / CALLS * 1e6
        data[key] = {
            "description": label,
            "plain_us_per_call": plain_us,
            "ratio": ratio.__dict__,
            "added_us_per_call": {
                "median": added.median / CALLS * 1e6,
                "low": added.low / CALLS * 1e6,
                "high": added.high / CALLS * 1e6,
                "rounds": added_us,
            },
            "timing": timing.to_json(),
        }
        rows.append(
            [
                label,
                f"{plain_us:.2f}",
                f"{added_us_median:+.2f} ({min(added_us):+.2f} to {max(added_us):+.2f})",
                ratio.shown(),
            ]
        )
        progress.advance()

    linear, relu = data["Linear"], data["ReLU"]
    relu_ratio = relu["ratio"]
    targets = [
        Target.at_most(
            "Hook cost per hooked nn.Linear call",
            linear["added_us_per_call"]["median"],
            1.5,
            "µs",
            f"median over {config.pairs} interleaved pairs; the call itself takes "
            f"{linear['plain_us_per_call']:.2f} µs, and an empty hook adds "
            f"{data['Linear empty hook']['added_us_per_call']['median']:.2f} µs",
        ),
        # "No change" means the pairs do not all fall on one side of 1 (a sign test at the pairs' resolution).
        Target(
            "Un-hooked module (nn.ReLU) call time",
            "no change: pair ratios on both sides of 1",
            relu_ratio["median"],
            "×",
            relu_ratio["low"] <= 1.0 <= relu_ratio["high"],
            f"pairs {relu_ratio['low']:.3f}–{relu_ratio['high']:.3f}; "
            f"{relu['added_us_per_call']['median']:+.3f} µs per call",
            limit=1.0,
        ),
    ]
    table = Table(
        f"Module call time with and without InputAwareAdamW attached (Linear {width}→{width}, batch {batch})",
        ["module call", "without hooks (µs)", "added (µs per call)", "ratio with / without"],
        rows,
        f"Each timed call makes {CALLS} module calls with grad enabled; the hooked side also releases its "
        "captures (as step() does), so that cost is included.",
    )
    return Result(tables=[table], targets=targets, data=data)


SECTION = Section(
    name="hook_cost",
    title="Hook cost per module call",
    summary=(
        "The same small model twice: once plain, once with an `InputAwareAdamW` attached (one forward hook "
        "on each module that owns a parameter, plus the root model's bookkeeping hooks). Each module is "
        "called directly, alternating plain and hooked; the added time per call comes from the per-pair "
        "differences. An `nn.ReLU` owns no parameter, gets no hook, and must keep PyTorch's fast call path."
    ),
    run=run,
)
