"""Section 1: capture's cost per captured call beside PyTorch's empty forward hook; un-watched modules pay nothing."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from inputaware_optim import Capture, InputAwareAdamW, Layer, Reduction, layer_kind
from inputaware_optim.kronecker import FactorSums

from ..core import Config, Progress, Result, Section, Table, Target
from ..timing import Ratio, Timing, interleave

CALLS = 16  # module calls per backward pass (and per timed call): per-pass costs are shared as in a model
RELU_BOUND = 1.02  # median ratio of the un-watched ReLU's call time to a plain ReLU's

PLAIN = "plain"
EMPTY_HOOK = "empty hook"
EMPTY_BOTH = "empty hooks both ways"
DROP_IN = "drop-in"
NO_OP = "no-op reduction"
FOOF = "FOOF reduction"
VARIANTS: dict[str, str] = {
    PLAIN: "Linear, no hook",
    EMPTY_HOOK: "Linear with an empty forward hook (PyTorch's dispatch of any hook)",
    EMPTY_BOTH: "Linear with a forward hook that puts an empty pre-hook on the output's autograd node",
    DROP_IN: "Linear in a model with InputAwareAdamW, no rule (no hook attached)",
    NO_OP: "Linear captured with a no-op Reduction (the capture's own cost)",
    FOOF: "Linear captured with FOOF's statistics (FactorSums)",
}


def _passes(module: nn.Module, x: Tensor) -> Callable[[], None]:
    """``CALLS`` calls of ``module``, one backward through all of them, then the gradients cleared."""
    params = [p for p in module.parameters()]

    def one_pass() -> None:
        total = module(x)
        for _ in range(CALLS - 1):
            total = total + module(x)
        total.sum().backward()
        for p in params:
            p.grad = None  # as zero_grad does: the capture drops what it held at the next pass

    return one_pass


def _empty_node_prehook(module: nn.Module, args: Any, output: Tensor) -> None:
    """The least a capture must do to follow a call into backward: a hook on its output's node."""
    if output.grad_fn is not None:
        output.grad_fn.register_prehook(lambda grads: None)


def _captured(linear: nn.Linear, reduction: Reduction) -> tuple[nn.Module, Capture]:
    """``linear`` inside a holder model whose capture runs ``reduction`` (and keeps no raw call).

    The module is then called directly, so the root model's per-forward hook is not counted:
    it runs once per forward of a whole model, not once per captured call.
    """
    holder = nn.Sequential(linear)
    capture = Capture(holder, keep_calls=False)
    capture.add_reduction(reduction)
    return holder, capture


def _per_call_us(timing: Timing, name: str) -> Ratio:
    """The time ``name`` adds per call over ``plain``, in µs, per pair."""
    added = timing.difference(name, PLAIN)
    return Ratio.of([d / CALLS * 1e6 for d in added.rounds])


def run(config: Config, progress: Progress) -> Result:
    # A microsecond-scale difference is measured on a small, cheap layer (so the pair-to-pair
    # noise of the call itself stays small in absolute terms) and over more rounds than usual.
    config = dataclasses.replace(config, pairs=config.pick(config.pairs, max(config.pairs, 31)))
    torch.manual_seed(config.seed)
    width, batch = 32, config.pick(4, 8)
    plain = nn.Linear(width, width)
    linears = {name: copy.deepcopy(plain) for name in VARIANTS}
    linears[EMPTY_HOOK].register_forward_hook(lambda *args: None)
    linears[EMPTY_BOTH].register_forward_hook(_empty_node_prehook)
    holder = nn.Sequential(linears[DROP_IN], nn.ReLU())
    drop_in = InputAwareAdamW(holder, lr=1e-3)
    _, no_op = _captured(linears[NO_OP], Reduction())
    kind = layer_kind(linears[FOOF])
    assert kind is not None
    second_moment = FactorSums([Layer(linears[FOOF], kind, True, {}, (linears[FOOF],))])
    _, foof = _captured(linears[FOOF], second_moment)
    x = torch.randn(batch, width)
    hooks = {name: len(linear._forward_hooks) for name, linear in linears.items()}

    # An un-watched module (nn.ReLU owns no parameter) in a model whose capture is active: no hook.
    relu_model = nn.Sequential(nn.Linear(width, width), nn.ReLU())
    relu_capture = Capture(relu_model, keep_calls=False)
    relu_capture.add_reduction(Reduction())
    hidden = torch.randn(batch, width)

    def relu_calls(relu: nn.Module) -> Callable[[], None]:
        def call() -> None:
            for _ in range(CALLS):
                relu(hidden)

        return call

    progress.start(2)
    progress.describe(f"Linear, {len(VARIANTS)} ways")
    timing = interleave({name: _passes(linear, x) for name, linear in linears.items()}, config)
    progress.advance()
    progress.describe("ReLU")
    relu_timing = interleave({"plain": relu_calls(nn.ReLU()), "watched model": relu_calls(relu_model[1])}, config)
    progress.advance()
    for capture in (no_op, foof, relu_capture):
        capture.remove()
    drop_in_hooks = hooks[DROP_IN]
    del drop_in

    plain_us = timing.per_call(PLAIN) / CALLS * 1e6
    added = {name: _per_call_us(timing, name) for name in VARIANTS if name != PLAIN}
    arithmetic = Ratio.of([f - n for f, n in zip(added[FOOF].rounds, added[NO_OP].rounds, strict=True)])
    rows = [[VARIANTS[PLAIN], str(hooks[PLAIN]), f"{plain_us:.2f}", "—"]]
    for name, value in added.items():
        rows.append(
            [
                VARIANTS[name],
                str(hooks[name]),
                f"{timing.per_call(name) / CALLS * 1e6:.2f}",
                f"{value.median:+.2f} ({value.low:+.2f} to {value.high:+.2f})",
            ]
        )
    rows.append(
        [
            "FOOF's arithmetic alone (FOOF reduction − no-op reduction)",
            "",
            "",
            f"{arithmetic.median:+.2f} ({arithmetic.low:+.2f} to {arithmetic.high:+.2f})",
        ]
    )
    empty, own = added[EMPTY_HOOK].median, added[NO_OP].median
    relative = own / empty if empty > 0 else float("inf")
    relu_ratio = relu_timing.ratio("watched model", "plain")
    relu_added = relu_timing.difference("watched model", "plain")
    relu_plain_us = relu_timing.per_call("plain") / CALLS * 1e6
    targets = [
        Target.at_most(
            "Capture's own cost per captured call (no-op Reduction), relative to PyTorch's empty forward hook",
            relative,
            1.5,
            "×",
            f"medians over {config.pairs} interleaved rounds: the capture adds {own:+.2f} µs per call (pairs "
            f"{added[NO_OP].low:+.2f} to {added[NO_OP].high:+.2f}), an empty forward hook {empty:+.2f} µs (pairs "
            f"{added[EMPTY_HOOK].low:+.2f} to {added[EMPTY_HOOK].high:+.2f}), and with an empty pre-hook on the "
            f"output's autograd node as well {added[EMPTY_BOTH].median:+.2f} µs; FOOF's reduction adds "
            f"{arithmetic.median:+.2f} µs of arithmetic on top; a Linear {width}→{width} call with its share of "
            f"backward takes {plain_us:.2f} µs",
        ).full_size_only(config),
        # An un-watched module keeps PyTorch's fast call path: a hook on it would add about an empty
        # hook's cost (several times a ReLU call's), far beyond this bound.
        Target.at_most(
            "Un-watched module (nn.ReLU) in a captured model: call time vs a plain ReLU",
            relu_ratio.median,
            RELU_BOUND,
            "×",
            f"median over {config.pairs} interleaved rounds, pairs {relu_ratio.low:.3f}–{relu_ratio.high:.3f}; "
            f"{relu_added.median / CALLS * 1e6:+.3f} µs per call against {relu_plain_us:.2f} µs for the call",
        ).full_size_only(config),
    ]
    table = Table(
        f"Cost per captured call (Linear {width}→{width}, batch {batch}, forward and its share of backward)",
        ["module call", "forward hooks", "per call (µs)", "added vs no hook (µs per call)"],
        rows,
        f"Each timed call runs {CALLS} calls of the module, one backward pass through all of them and clears "
        "the gradients (which drops what the capture held); the variants take turns. Added times are "
        f"medians over {config.pairs} rounds of the per-round difference from the plain Linear, with the "
        "range. The capture variants watch the Linear inside a holder model and call the Linear directly, "
        "so the root model's once-per-forward hook is not counted.",
    )
    data: dict[str, Any] = {
        "calls_per_pass": CALLS,
        "plain_us_per_call": plain_us,
        "forward_hooks": hooks,
        "drop_in_forward_hooks": drop_in_hooks,
        "added_us_per_call": {name: value.__dict__ for name, value in added.items()},
        "foof_arithmetic_us_per_call": arithmetic.__dict__,
        "capture_vs_empty_hook": relative,
        "timing": timing.to_json(),
        "relu": {
            "ratio": relu_ratio.__dict__,
            "added_us_per_call": relu_added.median / CALLS * 1e6,
            "timing": relu_timing.to_json(),
        },
    }
    return Result(tables=[table], targets=targets, data=data)


SECTION = Section(
    name="hook_cost",
    title="Capture cost per captured call",
    summary=(
        "With no rule, `InputAwareAdamW` attaches no hook: its calls cost what a plain module's do. "
        "When a reader is declared, the capture watches each module that owns a parameter: a forward "
        "hook runs the reader's `Reduction`, and a hook on the output's autograd node follows the call "
        "into backward. Copies of one `nn.Linear` take turns: plain, with an empty "
        "`register_forward_hook(lambda *a: None)` (PyTorch's own price for any hook), with a forward hook "
        "that only puts an empty pre-hook on the output's autograd node (the floor of following a call "
        "into backward), in a model with "
        "`InputAwareAdamW` (no hook), captured with a no-op `Reduction` (the capture's own cost), and "
        "captured with FOOF's statistics, `FactorSums` (the capture plus FOOF's arithmetic, `x̃ᵀx̃` per call). "
        "Each timed call runs the module several times with one backward through all calls; the added "
        "time per call comes from the per-round differences. An `nn.ReLU` owns no parameter, gets no "
        "hook, and must keep PyTorch's fast call path."
    ),
    run=run,
    estimate=(16, 26),
)
