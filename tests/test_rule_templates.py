"""Every rule template the docs show (README.md, docs/quickstart.md, CONTRIBUTING.md, docs/writing-a-rule.md) is
the same rule however a trainer steps: in a plain loop, under ``opt.step(closure)``, and under Lightning's
automatic optimization (which always steps through a closure). Each page's python blocks run as a reader pastes
them; every ``Rule`` and every optimizer subclass they define is then trained three ways."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from inputaware_optim import InputAwareOptimizer, InputAwareSGD, Rule

ROOT = Path(__file__).resolve().parent.parent
PAGES = {
    "README": ROOT / "README.md",
    "quickstart": ROOT / "docs" / "quickstart.md",
    "CONTRIBUTING": ROOT / "CONTRIBUTING.md",
    "writing-a-rule": ROOT / "docs" / "writing-a-rule.md",
}
PYTHON = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
LR, MOMENTUM, STEPS, BATCH = 0.05, 0.9, 4, 8


CLASS = re.compile(r"^class (\w+)\((Rule|InputAware\w+)\):", re.MULTILINE)


def rule_classes(page: str) -> list[str]:
    """The rules and optimizer subclasses a page defines, by name (found without running the page)."""
    return [name for block in PYTHON.findall(PAGES[page].read_text()) for name, _ in CLASS.findall(block)]


def defined(page: str, name: str) -> type:
    """Run the page's python blocks as a reader pastes them (README's each on its own, a docs page's in one
    session, as tests/test_docs.py runs them) and return the class ``name`` they define."""
    found: dict[str, Any] = {}
    shared: dict[str, Any] = {"__name__": page}
    for index, block in enumerate(PYTHON.findall(PAGES[page].read_text())):
        namespace = {"__name__": page} if page == "README" else shared
        exec(compile(block, f"{PAGES[page].name} block {index}", "exec"), namespace)
        found.update(namespace)
    template = found[name]
    assert isinstance(template, type) and issubclass(template, (Rule, InputAwareOptimizer))
    return template


TEMPLATES = [(page, name) for page in PAGES for name in rule_classes(page)]


def make(template: type, model: nn.Module) -> torch.optim.Optimizer:
    if issubclass(template, Rule):
        return InputAwareSGD(model, rules=[template()], lr=LR, momentum=MOMENTUM)
    return template(model, lr=LR, momentum=MOMENTUM)


def initial_net() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 2))
    return model.double()


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, 10, generator=g, dtype=torch.float64) * 3
    return TensorDataset(x, torch.randn(STEPS * BATCH, 2, generator=g, dtype=torch.float64))


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def plain_loop(optimizer_of: Callable[[nn.Module], Any]) -> nn.Module:
    model = initial_net()
    optimizer = optimizer_of(model)
    for x, y in DataLoader(data(), batch_size=BATCH):
        optimizer.zero_grad()
        loss_of(model, x, y).backward()
        optimizer.step()
    return model


def closure_loop(optimizer_of: Callable[[nn.Module], Any]) -> nn.Module:
    model = initial_net()
    optimizer = optimizer_of(model)
    for x, y in DataLoader(data(), batch_size=BATCH):

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            optimizer.zero_grad()
            loss = loss_of(model, x, y)
            loss.backward()
            return loss

        optimizer.step(closure)
    return model


def lightning_loop(optimizer_of: Callable[[nn.Module], Any], tmp_path: Path) -> nn.Module:
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = initial_net()

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return loss_of(self.net, *batch)

        def configure_optimizers(self) -> Any:
            return optimizer_of(self.net)

    module = Module()
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, DataLoader(data(), batch_size=BATCH))
    return module.net


@pytest.mark.filterwarnings("ignore:The '?train_dataloader'? does not have many workers")
@pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning")
@pytest.mark.parametrize("page, name", TEMPLATES, ids=[f"{page}:{name}" for page, name in TEMPLATES])
def test_a_documented_rule_is_the_same_rule_however_the_trainer_steps(page: str, name: str, tmp_path: Path) -> None:
    template = defined(page, name)
    reference = plain_loop(lambda m: make(template, m))
    stock = plain_loop(lambda m: torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM))
    closure = closure_loop(lambda m: make(template, m))
    lightning = lightning_loop(lambda m: make(template, m), tmp_path)
    for ours, by_closure, by_lightning in zip(
        reference.parameters(), closure.parameters(), lightning.parameters(), strict=True
    ):
        torch.testing.assert_close(by_closure, ours, rtol=0, atol=0)
        torch.testing.assert_close(by_lightning, ours, rtol=1e-12, atol=1e-12)
    assert any(not torch.allclose(p, q) for p, q in zip(reference.parameters(), stock.parameters(), strict=True)), (
        f"{page}'s {name} trains as stock SGD: the rule did nothing"
    )


def test_each_page_shows_a_rule() -> None:
    assert {page for page, _ in TEMPLATES} == set(PAGES)
