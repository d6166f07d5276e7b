"""The reads from device to host (synchronizations, on an accelerator) the library makes in its hooks and steps,
counted on the CPU by wrapping the tensor methods that synchronize, against the list docs/training-stack.md gives
and justifies ("Host synchronizations"). A read added anywhere in a hook or a step fails here."""

from __future__ import annotations

import collections
import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import inputaware_optim as io

# What makes a device wait for the host to read a value: the scalar and list conversions, truth values, nonzero.
SYNCING = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero")
LIBRARY = io.__name__ + "."
CPU_ONLY = {"_cpu_summary"}  # code that runs only on CPU tensors (the Monitor's summary there): no device to wait


@contextlib.contextmanager
def counted() -> Iterator[collections.Counter[str]]:
    """Count the synchronizing tensor methods the library's code calls (by ``file:line``) inside the block."""
    counts: collections.Counter[str] = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            frame = sys._getframe(1)
            if frame.f_globals.get("__name__", "").startswith(LIBRARY) and frame.f_code.co_name not in CPU_ONLY:
                counts[f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"] += 1
            return original(self, *args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrapped(original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 8)
        self.hidden = nn.Linear(8, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(tokens)))).mean(1)


def reads_per_step(make: Callable[[nn.Module], Any], steps: int = 4, micro_batches: int = 1) -> list[int]:
    """The library's reads in each of ``steps`` training steps (forward, backward, step)."""
    model = Net()
    optimizer = make(model)
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        tokens, target = torch.randint(0, 20, (8, 5), generator=generator), torch.randn(8, 3, generator=generator)
        with warnings.catch_warnings(), counted() as counts:
            warnings.simplefilter("ignore")
            optimizer.zero_grad()
            for _ in range(micro_batches):
                (nn.functional.mse_loss(model(tokens), target) / micro_batches).backward()
            optimizer.step()
        out.append(sum(counts.values()))
    return out


# Each: (optimizer maker, the reads of each of 4 steps: a list, or a number for every step) as documented.
BUDGETS: dict[str, tuple[Callable[[nn.Module], Any], Any]] = {
    "InputAwareSGD": (lambda m: io.InputAwareSGD(m, lr=0.1, momentum=0.9), 0),
    "InputAwareAdamW (fused)": (lambda m: io.InputAwareAdamW(m, lr=1e-3, fused=True), 0),
    "NLMS": (lambda m: io.NLMS(m, lr=0.1), 0),
    "LazyAdamW": (lambda m: io.LazyAdamW(m, lr=1e-3), 0),
    # One read on the steps that form inverses (every update_every steps): their condition numbers, all at once.
    "FOOF, update_every=2": (lambda m: io.FOOF(m, lr=0.1, update_every=2), [1, 0, 1, 0]),
    "KFAC, update_every=2": (lambda m: io.KFAC(m, lr=0.1, update_every=2), [1, 0, 1, 0]),
    "FOOF, statistics every 2": (lambda m: io.FOOF(m, lr=0.1, update_every=2, statistics_every=2), [1, 0, 1, 0]),
    # Under "eigh" each factor decomposed is first checked finite (one read each: 2 layers x 1 or 2 factors).
    "FOOF, inverse='eigh'": (lambda m: io.FOOF(m, lr=0.1, update_every=2, inverse="eigh"), [3, 0, 3, 0]),
    "KFAC, inverse='eigh'": (lambda m: io.KFAC(m, lr=0.1, update_every=2, inverse="eigh"), [5, 0, 5, 0]),
    # One read on each statistics step: the directions finite, the KL clip's scale, the condition numbers.
    "Eva": (lambda m: io.Eva(m, lr=0.1), 1),
    # One read per backward pass (its norms finite, the samples within the clip) and one per step (the check
    # that the per-sample gradients add up to the gradient backward computed).
    "DPSGD": (lambda m: io.DPSGD(m, lr=0.1, noise_multiplier=0.0), 2),
    # One read per logged step (the statistics and norms, at once); none on the others.
    "Monitor(every=2)": (lambda m: _with(m, lambda o: io.Monitor(o, every=2)), [1, 0, 1, 0]),
    # One read per step: whether every gradient is finite.
    "NonFiniteFinder": (lambda m: _with(m, io.NonFiniteFinder), 1),
}


def _with(model: nn.Module, tool: Callable[[Any], Any]) -> Any:
    optimizer = io.InputAwareAdamW(model, lr=1e-3)
    optimizer.tool = tool(optimizer)  # (kept alive beside it)
    return optimizer


@pytest.mark.parametrize("name", list(BUDGETS))
def test_the_library_reads_from_the_device_only_where_the_docs_say(name: str) -> None:
    make, budget = BUDGETS[name]
    expected = budget if isinstance(budget, list) else [budget] * 4
    assert reads_per_step(make) == expected


def test_micro_batches_add_dps_one_read_per_backward_pass_and_nothing_for_the_other_rules() -> None:
    dp = lambda m: io.DPSGD(m, lr=0.1, noise_multiplier=0.0, expected_batch_size=8)  # noqa: E731
    assert reads_per_step(dp, steps=2, micro_batches=3) == [4, 4]
    assert reads_per_step(BUDGETS["FOOF, update_every=2"][0], steps=2, micro_batches=3) == [1, 0]
    assert reads_per_step(BUDGETS["NLMS"][0], steps=2, micro_batches=3) == [0, 0]


def test_the_counter_sees_a_read() -> None:
    with counted() as counts:
        io.capture.parameter_names  # noqa: B018  (no read)
        from inputaware_optim.inverses import refuse_any

        refuse_any([])
    assert not counts
    model = Net()
    optimizer = io.FOOF(model, lr=0.1)
    with counted() as counts:
        nn.functional.mse_loss(model(torch.randint(0, 20, (8, 5))), torch.randn(8, 3)).backward()
        optimizer.step()
    assert sum(counts.values()) == 1 and all(where.startswith("inverses.py") for where in counts)
