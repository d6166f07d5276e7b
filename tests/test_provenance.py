"""``Capture.follow_samples``: which watched calls hold the samples, told by the computation of each forward."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from inputaware_optim import Capture

from .conftest import hooks_on

PER_SAMPLE, BROADCAST, UNKNOWN = ("per sample", None), "broadcast", ("unknown", None)


def mode_active() -> bool:
    return torch.overrides._is_torch_function_mode_enabled()


class Positions(nn.Module):
    """Tokens plus positions (``how``: expanded to the batch, broadcast, or beside the output), and learned
    queries through a layer (expanded before the call, or after it)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos, self.head = nn.Embedding(10, 4), nn.Embedding(6, 4), nn.Linear(4, 3)
        self.queries, self.proj = nn.Parameter(torch.randn(4, 4)), nn.Linear(4, 4)
        self.how = how
        self.kept: list[weakref.ref[torch.Tensor]] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        batch, length = ids.shape
        h = self.tok(ids)
        if self.how == "raise":
            raise RuntimeError("a forward that fails")
        at = torch.arange(length)
        if self.how == "expanded":
            h = h + self.pos(at.expand(batch, length)) + self.proj(self.queries.tanh().expand(batch, 4, 4))[:, :1]
        elif self.how == "broadcast":
            h = h + self.pos(at) + self.proj(self.queries.tanh())[:1].expand(batch, 1, 4)
        else:  # neither meets the samples: their rows cannot be told
            self.side = self.pos(at).sum() + self.proj(self.queries.tanh()).sum()
        scratch = h * 2  # (nothing keeps it: autograd saves no input of a product by a number)
        self.kept.append(weakref.ref(scratch))
        return self.head(torch.tanh(h))


def verdicts(capture: Capture, model: nn.Module, x: torch.Tensor) -> dict[str, tuple[str, str | None]] | None:
    model(x).sum().backward()
    forward = capture.calls()[0].forward
    found = capture.samples_of_calls(forward)  # (the model itself, which owns queries, as the hooks' order has it)
    return None if found is None else {capture.name(m): v for m, v in found.items() if m is not model}


def test_a_forward_says_which_calls_hold_the_samples() -> None:
    ids = torch.randint(0, 10, (6, 6), generator=torch.Generator().manual_seed(0))  # batch 6, context 6
    for how, expected in (
        ("expanded", {"tok": PER_SAMPLE, "pos": PER_SAMPLE, "proj": PER_SAMPLE, "head": PER_SAMPLE}),
        ("beside", {"tok": PER_SAMPLE, "pos": UNKNOWN, "proj": UNKNOWN, "head": PER_SAMPLE}),
    ):
        model = Positions(how)
        with Capture(model) as capture:
            capture.follow_samples()
            assert verdicts(capture, model, ids) == expected, how
    model = Positions("broadcast")
    with Capture(model) as capture:
        capture.follow_samples()
        found = verdicts(capture, model, ids)
    assert found is not None and {k for k, (verdict, _) in found.items() if verdict == BROADCAST} == {"pos", "proj"}
    assert found["pos"][1] == "add takes it as (6, 4) with the samples' (6, 6, 4) into (6, 6, 4)"
    assert found["proj"][1] is not None and found["proj"][1].startswith("add takes it as (6, 1, 4)")


def test_sequence_first_tensors_hold_the_samples_along_dim_1() -> None:
    class SequenceFirst(nn.Module):
        def __init__(self, expand: bool) -> None:
            super().__init__()
            self.tok, self.pos, self.expand = nn.Embedding(10, 4), nn.Embedding(5, 4), expand

        def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (T, B)
            at = torch.arange(ids.shape[0])[:, None]
            return self.tok(ids) + self.pos(at.expand(ids.shape) if self.expand else at)

    ids = torch.randint(0, 10, (5, 5))  # T = B = 5
    for expand, expected in ((True, "per sample"), (False, BROADCAST)):
        model = SequenceFirst(expand)
        with Capture(model) as capture:
            capture.follow_samples(batch_dim=1)
            found = verdicts(capture, model, ids)
        assert found is not None and found["pos"][0] == expected and found["tok"] == PER_SAMPLE


def test_forwards_not_followed_say_nothing_and_the_mode_ends_with_each_forward() -> None:
    model, ids = Positions("expanded"), torch.randint(0, 10, (3, 6))
    with Capture(model) as capture:
        assert verdicts(capture, model, ids) is None  # before follow_samples
        capture.follow_samples()
        capture.clear()
        assert verdicts(capture, model, ids) is not None and not mode_active()
        with torch.no_grad():
            model(ids)
        assert capture.samples_of_calls(capture._log.forwards) is None and not mode_active()
        model.how = "raise"
        with pytest.raises(RuntimeError, match="a forward that fails"):  # the mode ends with it too
            model(ids)
        assert not mode_active()
        model.how = "expanded"
        capture.follow_samples(None)
        capture.clear()
        assert verdicts(capture, model, ids) is None
        with pytest.raises(ValueError, match="batch_dim"):
            capture.follow_samples(2)
    assert hooks_on(model) == 0


def test_removing_the_capture_during_a_forward_ends_the_following() -> None:
    class Removes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 3)
            self.capture: Capture | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.layer(x)
            assert self.capture is not None and mode_active()
            self.capture.remove()
            assert not mode_active()
            return h * 2

    model = Removes()
    model.capture = Capture(model)
    model.capture.follow_samples()
    model(torch.randn(2, 3))
    assert not mode_active() and hooks_on(model) == 0


def test_following_keeps_no_tensor_of_the_forward() -> None:
    model = Positions("expanded")
    with Capture(model) as capture:
        capture.follow_samples()
        model(torch.randint(0, 10, (3, 6))).sum().backward()
        gc.collect()
        assert model.kept[-1]() is None
        assert capture._log.provenances[capture._log.forwards].tags == {}
