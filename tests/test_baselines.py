"""The benchmarks' Muon recipe (``benchmarks/baselines.py``) and the convergence section's measured time to result."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
from torch import nn

from inputaware_optim import FOOF

pytest.importorskip("sklearn")  # benchmarks.digits, through the convergence section (the bench extra)

from benchmarks import baselines, gpt, rules
from benchmarks.models import SmallCNN, autoencoder, mlp

BFLOAT16_PRECISION = 2e-2  # relative: bfloat16 keeps 8 bits of mantissa, so each Newton–Schulz product rounds at ~4e-3


def _updates(
    optimizer: type[torch.optim.Optimizer], shape: tuple[int, int], steps: int, **options: Any
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(shape, generator=generator)
    parameter = nn.Parameter(start.clone())
    stepper = optimizer([parameter], **options)
    for _ in range(steps):
        parameter.grad = torch.randn(shape, generator=generator)
        stepper.step()
    return parameter.detach() - start


@pytest.mark.parametrize("shape", [(48, 32), (32, 48), (40, 40)])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_float32_muon_is_torch_muon_to_bfloat16_precision(
    shape: tuple[int, int], nesterov: bool, adjust_lr_fn: str | None
) -> None:
    options = {"lr": 0.02, "weight_decay": 0.1, "nesterov": nesterov, "adjust_lr_fn": adjust_lr_fn}
    shipped = _updates(torch.optim.Muon, shape, 5, **options)
    ours = _updates(baselines.Float32Muon, shape, 5, **options)
    assert float((ours - shipped).norm() / shipped.norm()) < BFLOAT16_PRECISION


def test_float32_muon_orthogonalizes_in_float32_and_keeps_torch_state() -> None:
    parameter = nn.Parameter(torch.randn(16, 8))
    optimizer = baselines.Float32Muon([parameter], lr=0.1)
    parameter.grad = torch.randn(16, 8)
    optimizer.step()
    assert set(optimizer.state[parameter]) == {"momentum_buffer"}
    # Its Newton–Schulz output is closer to the exact polynomial (float64) than bfloat16's can be.
    update = torch.randn(16, 8, dtype=torch.float64)
    coefficients = optimizer.param_groups[0]["ns_coefficients"]
    exact = baselines.newton_schulz(update, coefficients, 5, 1e-7)
    single = baselines.newton_schulz(update.float(), coefficients, 5, 1e-7).double()
    assert float((single - exact).norm() / exact.norm()) < 1e-5


@pytest.mark.parametrize(
    ("build", "hidden"),
    [
        (lambda: mlp(64, 128, 10), ["2.weight"]),
        (lambda: SmallCNN(1, 8, (16, 32), 64), ["head.1.weight"]),
        (lambda: autoencoder((64, 32, 16, 32, 64)), ["2.weight", "4.weight"]),
        (
            lambda: gpt.build(gpt.SIZES["quick"]),
            [f"blocks.{b}.{n}.weight" for b in range(2) for n in ("qkv", "projection", "expand", "contract")],
        ),
    ],
)
def test_muon_recipe_takes_the_hidden_matrices_and_adamw_the_rest(build: Any, hidden: list[str]) -> None:
    model = build()
    names = {id(p): name for name, p in model.named_parameters()}
    optimizer = baselines.muon(model, 1e-3)
    assert isinstance(optimizer, baselines.Combined)
    muon, adamw = optimizer.parts
    assert isinstance(muon, baselines.Float32Muon) and type(adamw) is torch.optim.AdamW
    assert sorted(names[id(p)] for g in muon.param_groups for p in g["params"]) == sorted(hidden)
    rest = [names[id(p)] for g in adamw.param_groups for p in g["params"]]
    assert sorted(rest + hidden) == sorted(names.values())  # disjoint, and every parameter trained
    for part in optimizer.parts:
        group = part.param_groups[0]
        assert group["lr"] == 1e-3 and group["weight_decay"] == baselines.WEIGHT_DECAY
    assert muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    assert type(baselines.muon(model, 1e-3, torch.optim.Muon).parts[0]) is torch.optim.Muon


def test_foof_on_muon_is_the_muon_recipe_with_foof_in_front_of_its_muon_part() -> None:
    """The hidden matrices take FOOF's preconditioned gradient into Float32Muon (the recipe's options),
    the rest AdamW's own update: checked against both stepped by hand on FOOF's gradient."""
    torch.manual_seed(0)
    model = autoencoder((16, 12, 8, 12, 16))
    twin = autoencoder((16, 12, 8, 12, 16))
    twin.load_state_dict(model.state_dict())
    combined = rules.foof_on_muon()(model, 1e-2)
    foof, adamw = combined.parts
    assert isinstance(foof, FOOF) and type(adamw) is torch.optim.AdamW
    hidden = baselines.hidden_matrices(model)
    assert [p for g in foof.param_groups for p in g["params"]] == hidden
    assert foof.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    assert foof.param_groups[0]["weight_decay"] == adamw.param_groups[0]["weight_decay"] == baselines.WEIGHT_DECAY
    twin_hidden = baselines.hidden_matrices(twin)
    by_hand = [
        baselines.Float32Muon(
            twin_hidden, lr=1e-2, weight_decay=baselines.WEIGHT_DECAY, adjust_lr_fn="match_rms_adamw"
        ),
        torch.optim.AdamW(
            [p for p in twin.parameters() if all(p is not q for q in twin_hidden)],
            lr=1e-2,
            weight_decay=baselines.WEIGHT_DECAY,
        ),
    ]
    x = torch.rand(32, 16)
    for _ in range(3):
        combined.zero_grad()
        model(x).square().mean().backward()
        combined.step()  # FOOF writes its preconditioned gradient into .grad before Muon's step
        for part in by_hand:
            part.zero_grad()
        twin(x).square().mean().backward()
        for ours, theirs in zip(hidden, twin_hidden, strict=True):
            assert not torch.allclose(ours.grad, theirs.grad)  # preconditioned, not the raw gradient
            theirs.grad = ours.grad.clone()  # what FOOF handed Muon
        for part in by_hand:
            part.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))


def test_combined_steps_as_its_parts_stepped_by_hand() -> None:
    torch.manual_seed(0)
    model = mlp(8, 16, 4)
    twin = mlp(8, 16, 4)
    twin.load_state_dict(model.state_dict())
    combined = baselines.muon(model, 1e-2)
    by_hand = [
        baselines.Float32Muon(
            baselines.hidden_matrices(twin),
            lr=1e-2,
            weight_decay=baselines.WEIGHT_DECAY,
            adjust_lr_fn="match_rms_adamw",
        ),
        torch.optim.AdamW(
            [p for p in twin.parameters() if p is not twin[2].weight], lr=1e-2, weight_decay=baselines.WEIGHT_DECAY
        ),
    ]
    x = torch.randn(32, 8)
    for _ in range(3):
        combined.zero_grad()
        model(x).square().mean().backward()
        combined.step()
        for part in by_hand:
            part.zero_grad()
        twin(x).square().mean().backward()
        for part in by_hand:
            part.step()
    for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    assert all(p.grad is not None for p in model.parameters())
    combined.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    # A schedule setting the rate through the combined groups sets it in the parts.
    for group in combined.param_groups:
        group["lr"] = 0.5
    assert all(group["lr"] == 0.5 for part in combined.parts for group in part.param_groups)
    state = combined.state_dict()
    again = baselines.muon(model, 1e-2)
    again.load_state_dict(state)
    hidden = baselines.hidden_matrices(model)[0]
    assert torch.equal(
        again.parts[0].state[hidden]["momentum_buffer"], combined.parts[0].state[hidden]["momentum_buffer"]
    )


def test_gpt_run_clock_leaves_out_evaluations(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.core import Config
    from benchmarks.sections import convergence

    pause = 0.05

    def slow_evaluate(model: nn.Module, size: gpt.GPTSize, windows: int = 32, seed: int = 1234) -> float:
        time.sleep(pause)
        return 1.0

    monkeypatch.setattr(gpt, "evaluate", slow_evaluate)
    task = convergence._gpt_task(Config(size="quick"))
    start = time.perf_counter()
    run = convergence.train_gpt(task, baselines.muon, 1e-3, 4, 1, seed=0)
    wall = time.perf_counter() - start
    assert run["step"] == [0, 1, 2, 3, 4] and not run["diverged"]
    assert run["measured_training_seconds"] == run["seconds"][-1] > 0
    assert run["measured_training_seconds"] <= wall - 5 * pause  # five evaluations, none on the clock
    assert all(math.isfinite(v) for v in run["train_loss"])


def _history(values: list[float], seed: int, seconds_per_step: float) -> dict[str, Any]:
    steps = [10 * i for i in range(len(values))]
    return {
        "lr": 0.1,
        "seed": seed,
        "diverged": False,
        "step": steps,
        "seconds": [seconds_per_step * s for s in steps],
        "measured_training_seconds": seconds_per_step * steps[-1],
        "test_accuracy": values,
    }


def test_convergence_goal_counts_muon_as_stock_and_times_are_measured() -> None:
    from benchmarks.digits import tasks
    from benchmarks.sections.convergence import _outcome

    plateau = [0.5, 0.9, 0.9, 0.9, 0.9]  # final (mean of the last quarter): 0.9
    trained = {
        "seed_runs": {
            "SGD (momentum 0.9)": [_history([0.1, 0.5, 0.8, 0.8, 0.8], seed, 0.1) for seed in range(3)],
            "AdamW": [_history([0.1, 0.5, 0.85, 0.85, 0.85], seed, 0.1) for seed in range(3)],
            "Muon": [_history(plateau, seed, 0.2) for seed in range(3)],
            "FOOF": [
                _history([0.1, 0.9, 0.9, 0.9, 0.9], 0, 0.15),
                _history([0.1, 0.5, 0.5, 0.5, 0.5], 1, 0.15),
                _history([0.1, 0.95, 0.95, 0.95, 0.95], 2, 0.15),
            ],
            "K-FAC": [_history([0.1, 0.2, 0.2, 0.2, 0.2], seed, 0.1) for seed in range(3)],
        },
    }
    outcome = _outcome(tasks()["CNN"], trained)
    # Muon sets the goal and, SGD and AdamW never reaching it, is the fastest stock optimizer to it.
    assert outcome["best_stock"] == "Muon" and outcome["goal"] == pytest.approx(0.9)
    assert outcome["faster_stock"] == "Muon" and outcome["time_to_goal"]["Muon"] == pytest.approx(2.0)
    assert outcome["reach"]["FOOF"]["step"] == [10, None, 10]
    assert outcome["time_to_goal"]["FOOF"] == pytest.approx(1.5)  # measured: median of 1.5 s, never, 1.5 s
    assert outcome["time_to_goal"]["K-FAC"] == math.inf and outcome["best_candidate"] == "FOOF"
    assert outcome["ratio"] == pytest.approx(0.75)


def test_convergence_an_input_aware_run_reaching_a_goal_no_stock_optimizer_reaches_counts_as_faster() -> None:
    from benchmarks.digits import tasks
    from benchmarks.sections.convergence import _outcome

    # Two seeds: the goal (AdamW's median final, 0.85) is reached by one AdamW seed only.
    trained = {
        "seed_runs": {
            "SGD (momentum 0.9)": [_history([0.1, 0.2, 0.2, 0.2, 0.2], seed, 0.1) for seed in range(2)],
            "AdamW": [_history([0.1, 0.8, 0.8, 0.8, 0.8], 0, 0.1), _history([0.1, 0.9, 0.9, 0.9, 0.9], 1, 0.1)],
            "Muon": [_history([0.1, 0.5, 0.5, 0.5, 0.5], seed, 0.1) for seed in range(2)],
            "Eva": [_history([0.1, 0.5, 0.9, 0.9, 0.9], seed, 0.1) for seed in range(2)],
        },
    }
    outcome = _outcome(tasks()["CNN"], trained)
    assert outcome["goal"] == pytest.approx(0.85) and outcome["time_to_goal"]["AdamW"] == math.inf
    assert outcome["best_candidate"] == "Eva" and outcome["time_to_goal"]["Eva"] == pytest.approx(2.0)
    assert outcome["ratio"] == 0.0
