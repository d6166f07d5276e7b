"""FOOF inside a real Lightning ``Trainer`` loop, against a hand-written loop on the same data.

Lightning's automatic optimization does not run a step the way the README's loop does. With
``accumulate_grad_batches=2`` each optimizer step is, in this order:

1. micro-batch 0, run as a bare closure: ``training_step`` (the forward), then
   ``optimizer.zero_grad()``, then ``(loss / 2).backward()``;
2. micro-batch 1, inside ``optimizer.step(closure)``: the closure runs ``training_step`` and
   ``(loss / 2).backward()`` (no ``zero_grad``: it is not the first of the window).

With ``accumulate_grad_batches=1`` the single micro-batch is step 1 run inside
``optimizer.step(closure)``: forward, ``zero_grad()``, backward. So ``zero_grad()`` comes
*after* a forward whose inputs the step needs. The reference is the README's loop, the
semantics FOOF documents: ``zero_grad()``, then every micro-batch's forward and backward, then
``step()``, with the statistics averaged over all micro-batches of the step. Everything runs
in float64 on the CPU, where Lightning and the hand loop do the same arithmetic in the same
order, so the tolerance is tight (1e-12).

``test_hand_loop_is_lightnings_arithmetic`` checks the harness itself with plain
``torch.optim.SGD``, which has no captures: if it fails, the reference loop, not the library,
is wrong.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("lightning")
import lightning.pytorch as pl

from inputaware_optim import FOOF, WhitenedMuon

pytestmark = [
    # Lightning's advice for a real data pipeline; this one is 48 rows in memory.
    pytest.mark.filterwarnings("ignore:The '?train_dataloader'? does not have many workers"),
    pytest.mark.filterwarnings("ignore:.*is smaller than the logging interval"),
    # Lightning's own pytree helper on this torch, about torch's API, not this library's.
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"),
]

TOLERANCE = {"rtol": 1e-12, "atol": 1e-12}
LR, MOMENTUM = 0.1, 0.9
BATCH = 8


def foof(net: nn.Module) -> torch.optim.Optimizer:
    return FOOF(net, lr=LR, momentum=MOMENTUM, update_every=1)


def whitened_muon(net: nn.Module) -> torch.optim.Optimizer:
    return WhitenedMuon(net, lr=0.02, update_every=1)


def sgd(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)


def dataset(samples: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (samples,), generator=g)
    return TensorDataset(x, y)


def initial_net() -> nn.Sequential:
    """The same initial weights on every call (without touching the global RNG)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    return net.double()


def linear_weights(net: nn.Module) -> list[nn.Parameter]:
    return [m.weight for m in net.modules() if isinstance(m, nn.Linear)]


class Classifier(pl.LightningModule):
    def __init__(self, net: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]) -> None:
        super().__init__()
        self.net = net
        self.make_optimizer = make_optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.make_optimizer(self.net)


def trainer(root: Path, accumulate: int, max_steps: int = -1, max_epochs: int | None = None) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision="64-true",
        max_steps=max_steps,
        max_epochs=max_epochs,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )


def lightning_run(
    root: Path,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    data: TensorDataset,
    steps: int,
    accumulate: int,
    by_epochs: bool = False,
) -> tuple[Classifier, pl.Trainer]:
    """``steps`` optimizer steps: stopped by ``max_steps``, or by ``max_epochs`` at the end of an epoch."""
    module = Classifier(initial_net(), make_optimizer)
    if by_epochs:
        t = trainer(root, accumulate, max_epochs=steps * accumulate * BATCH // len(data))
    else:
        t = trainer(root, accumulate, max_steps=steps)
    t.fit(module, DataLoader(data, batch_size=BATCH, shuffle=False))
    assert t.global_step == steps
    return module, t


def hand_run(
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    data: TensorDataset,
    steps: int,
    accumulate: int,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The README's accumulation loop: zero_grad, every micro-batch's forward and backward, step."""
    net = initial_net()
    opt = make_optimizer(net)
    batches = itertools.cycle(DataLoader(data, batch_size=BATCH, shuffle=False))
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(accumulate):
            x, y = next(batches)
            (F.cross_entropy(net(x), y) / accumulate).backward()  # Lightning divides the same way
        opt.step()
    return net, opt


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")


def assert_foof_state(opt: torch.optim.Optimizer, net: nn.Module, steps: int) -> None:
    for weight in linear_weights(net):
        state = opt.rules[0].state[weight]  # type: ignore[attr-defined]
        assert "input_second_moment" in state, (
            f"FOOF recorded no input statistics for a {tuple(weight.shape)} weight (state keys: {sorted(state)}): "
            "the inputs captured in the forward did not reach its step"
        )
        assert int(state["statistics_steps"]) == steps


def max_difference(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_hand_loop_is_lightnings_arithmetic(tmp_path: Path) -> None:
    """The harness: plain SGD (no captures) under Lightning equals the hand loop."""
    module, _ = lightning_run(tmp_path, sgd, dataset(), steps=3, accumulate=2)
    net, _ = hand_run(sgd, dataset(), steps=3, accumulate=2)
    assert_same_parameters(module.net, net)


@pytest.mark.parametrize("accumulate", [2, 1], ids=lambda k: f"accumulate={k}")
def test_foof_under_lightning_matches_hand_loop(tmp_path: Path, accumulate: int) -> None:
    data = dataset()
    module, t = lightning_run(tmp_path, foof, data, steps=3, accumulate=accumulate)
    net, opt = hand_run(foof, data, steps=3, accumulate=accumulate)

    # The reference itself preconditioned: statistics recorded, and not where plain SGD lands.
    assert_foof_state(opt, net, steps=3)
    plain, _ = hand_run(sgd, data, steps=3, accumulate=accumulate)
    assert max_difference(net, plain) > 1e-3

    # Lightning's run: the same statistics, hence the same parameters.
    (lightning_opt,) = t.optimizers
    assert isinstance(lightning_opt, FOOF)
    assert_foof_state(lightning_opt, module.net, steps=3)
    for weight, ref in zip(linear_weights(module.net), linear_weights(net), strict=True):
        shape = tuple(weight.shape)
        torch.testing.assert_close(
            lightning_opt.rules[0].state[weight]["input_second_moment"],
            opt.rules[0].state[ref]["input_second_moment"],
            **TOLERANCE,
            msg=lambda m, shape=shape: f"input_second_moment of the {shape} weight, Lightning vs the hand loop: {m}",
        )
    assert_same_parameters(module.net, net)
    assert max_difference(module.net, plain) > 1e-3


def test_whitened_muon_under_lightning_matches_hand_loop(tmp_path: Path) -> None:
    """Lightning steps through a closure, with accumulation: WhitenedMuon's steps there are the hand loop's."""
    data = dataset()
    module, t = lightning_run(tmp_path, whitened_muon, data, steps=3, accumulate=2)
    net, opt = hand_run(whitened_muon, data, steps=3, accumulate=2)
    for weight in linear_weights(net):
        assert opt.rules[0].state[weight]["statistics_steps"] == 3  # type: ignore[attr-defined]
    (lightning_opt,) = t.optimizers
    assert isinstance(lightning_opt, WhitenedMuon)
    assert_same_parameters(module.net, net)


@pytest.mark.parametrize("rule", ["sgd", "foof"])
def test_resume_from_a_lightning_checkpoint(tmp_path: Path, rule: str) -> None:
    """2 steps, ``save_checkpoint``, resume in a new Trainer to 4: the same as 4 steps straight.

    32 samples make an epoch of exactly 2 steps, and the runs stop by ``max_epochs``, so the
    checkpoint ends an epoch: Lightning cannot resume a plain DataLoader mid-epoch (it starts
    the epoch over), and a run stopped by ``max_steps`` on an epoch's last batch resumes with
    one extra step on a single micro-batch (Lightning 2.6). The ``sgd`` case checks that
    procedure itself, without captures.
    """
    make_optimizer = {"sgd": sgd, "foof": foof}[rule]
    data = dataset(32)
    _, first = lightning_run(tmp_path / "first", make_optimizer, data, steps=2, accumulate=2, by_epochs=True)
    ckpt = tmp_path / "two-steps.ckpt"
    first.save_checkpoint(ckpt)

    resumed = Classifier(initial_net(), make_optimizer)
    t = trainer(tmp_path / "resumed", accumulate=2, max_epochs=2)
    t.fit(resumed, DataLoader(data, batch_size=BATCH, shuffle=False), ckpt_path=ckpt)
    assert t.global_step == 4
    straight, _ = lightning_run(tmp_path / "straight", make_optimizer, data, steps=4, accumulate=2, by_epochs=True)
    net, opt = hand_run(make_optimizer, data, steps=4, accumulate=2)

    if rule == "foof":
        assert_foof_state(opt, net, steps=4)
        (resumed_opt,) = t.optimizers
        assert isinstance(resumed_opt, FOOF)
        assert_foof_state(resumed_opt, resumed.net, steps=4)
    assert_same_parameters(resumed.net, straight.net)
    assert_same_parameters(resumed.net, net)
