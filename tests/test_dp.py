"""DP-SGD / DP-AdamW against per-sample gradients from torch.func.vmap(grad), one sample at a time."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.checkpoint import checkpoint

from inputaware_optim import DPSGD, DPAdamW


class Net(nn.Module):
    """Every kind of per-sample path: embedding (closed form, padding), conv1d and layer norm
    (generic vmap fallback), conv2d and a sequence linear (ghost norm)."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 6, padding_idx=0)
        self.conv = nn.Conv1d(6, 6, 3, padding=1)
        self.image = nn.Conv2d(1, 2, 3, padding=1)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 20 if tied else 3)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(self.embed(tokens).transpose(1, 2)))
        h = self.image(h[:, None]).mean(1).transpose(1, 2)
        return self.head(self.norm(h)).mean(1)


def per_sample_clipped_mean(
    model: nn.Module, tokens: torch.Tensor, target: torch.Tensor, clip: float
) -> dict[str, Any]:
    """The textbook DP-SGD gradient without noise: per-sample gradients by vmap(grad), clipped, averaged."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_of_one(p: dict[str, torch.Tensor], t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (functional_call(model, p, (t[None],)) - y[None]).pow(2).sum()

    per_sample = vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, tokens, target)
    norms = torch.sqrt(sum(g.reshape(len(tokens), -1).pow(2).sum(1) for g in per_sample.values()))
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    return {k: torch.tensordot(factors, g, dims=1) / len(tokens) for k, g in per_sample.items()}


def data(batch: int, seed: int, outputs: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 20, (batch, 7), generator=generator)
    return tokens, torch.randn(batch, outputs, generator=generator, dtype=torch.float64)


@given(batch=st.integers(1, 6), clip=st.sampled_from([1e-3, 0.05, 0.5, 100.0]), tied=st.booleans())
def test_noise_free_step_equals_clipped_per_sample_gradients(batch: int, clip: float, tied: bool) -> None:
    model = Net(tied).double()
    tokens, target = data(batch, seed=batch, outputs=20 if tied else 3)
    expected = per_sample_clipped_mean(model, tokens, target, clip)
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=clip, noise_multiplier=0.0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    (model(tokens) - target).pow(2).sum(1).mean().backward()
    optimizer.step()
    for name, param in model.named_parameters():
        torch.testing.assert_close(before[name] - param.detach(), expected[name], rtol=1e-9, atol=1e-12)


def test_dp_adamw_is_adamw_on_the_private_gradient() -> None:
    model, twin = Net().double(), Net().double()
    tokens, target = data(4, seed=1)
    expected = per_sample_clipped_mean(twin, tokens, target, 0.1)
    optimizer = DPAdamW(model, lr=0.01, max_grad_norm=0.1, noise_multiplier=0.0)
    reference = torch.optim.AdamW(twin.parameters(), lr=0.01)
    (model(tokens) - target).pow(2).sum(1).mean().backward()
    optimizer.step()
    for name, param in twin.named_parameters():
        param.grad = expected[name].clone()
    reference.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


def test_gradient_accumulation_equals_the_concatenated_batch() -> None:
    tokens, target = data(6, seed=2)
    a, b = Net().double(), Net().double()
    oa = DPSGD(a, lr=0.5, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=6)
    ob = DPSGD(b, lr=0.5, max_grad_norm=0.05, noise_multiplier=0.0)
    unsure = DPSGD(a, lr=0.5, max_grad_norm=0.05, noise_multiplier=0.0)  # not told the step's batch
    for part in (slice(0, 2), slice(2, 6)):  # micro-batches of 2 and 4: each loss weighted by its share
        ((a(tokens[part]) - target[part]).pow(2).sum(1).mean() * (part.stop - part.start) / 6).backward()
    before = [p.detach().clone() for p in a.parameters()]
    with pytest.raises(RuntimeError, match="expected_batch_size"):
        unsure.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), before, strict=True))
    oa.step()
    (b(tokens) - target).pow(2).sum(1).mean().backward()
    ob.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


def test_summed_loss_reduction() -> None:
    tokens, target = data(5, seed=3)
    mean_model, sum_model = Net().double(), Net().double()
    mean_opt = DPSGD(mean_model, lr=1.0, max_grad_norm=0.1, noise_multiplier=0.0)
    sum_opt = DPSGD(sum_model, lr=1.0 / 5, max_grad_norm=0.1, noise_multiplier=0.0, loss_reduction="sum")
    (mean_model(tokens) - target).pow(2).sum(1).mean().backward()
    (sum_model(tokens) - target).pow(2).sum().backward()
    mean_opt.step()
    sum_opt.step()
    for p, q in zip(mean_model.parameters(), sum_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


def test_noise_has_the_stated_standard_deviation_and_is_seedable() -> None:
    def noisy_step(seed: int) -> torch.Tensor:
        layer = nn.Linear(200, 100, bias=False).double()
        nn.init.zeros_(layer.weight)
        generator = torch.Generator().manual_seed(seed)
        optimizer = DPSGD(layer, lr=1.0, max_grad_norm=2.0, noise_multiplier=1.5, generator=generator)
        x = torch.randn(8, 200, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        layer(x).sum().backward()
        optimizer.step()
        return -layer.weight.detach().clone()  # the step taken: the private gradient (lr = 1, from zero)

    first, again, other = noisy_step(0), noisy_step(0), noisy_step(1)
    assert torch.equal(first, again)  # the same generator seed, the same noise
    assert not torch.equal(first, other)
    # The clipped signal is at most C / B per sample-mean; the noise std is sigma * C / B = 0.375.
    residual = first - first.mean()
    assert abs(residual.std().item() - 1.5 * 2.0 / 8) < 0.02
    assert abs(first.mean().item()) < 0.05


def test_batch_norm_is_refused_and_uncaptured_weights_raise_before_any_change() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    with pytest.raises(ValueError, match=r"BatchNorm1d.*mixes the samples"):
        DPSGD(model, lr=0.1)
    assert all(not m._forward_hooks for m in model.modules())  # refused before any hook went on
    attention = nn.MultiheadAttention(4, 1, batch_first=True)  # out_proj.weight is used without calling out_proj
    with pytest.raises(ValueError, match=r"MultiheadAttention\): its out_proj.weight is used without calling"):
        DPSGD(attention, lr=0.1, noise_multiplier=0.0)
    assert all(not m._forward_hooks for m in attention.modules())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_grad_norm": 0.0}, "Invalid max_grad_norm"),
        ({"noise_multiplier": -1.0}, "Invalid noise_multiplier"),
        ({"loss_reduction": "median"}, "Invalid loss_reduction"),
    ],
)
def test_bad_configuration(kwargs: dict[str, Any], message: str) -> None:
    model = nn.Linear(3, 3)
    with pytest.raises(ValueError, match=message):
        DPSGD(model, lr=0.1, **kwargs)
    assert not model._forward_hooks


class _Checkpointed(nn.Module):
    """A layer used twice in one checkpointed region and once more in a second region."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(5, 5)
        self.other = nn.Linear(5, 5)
        self.head = nn.Linear(5, 2)
        self.checkpointed = checkpointed
        self.watched: list[Any] = []

    def _first(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(h))
        self.watched.append(weakref.ref(h))
        h = torch.tanh(self.other(h))
        self.watched.append(weakref.ref(h))
        return torch.tanh(self.shared(h))

    def _second(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.other(h))
        self.watched.append(weakref.ref(h))
        return torch.tanh(self.shared(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        run = (lambda f, h: checkpoint(f, h, use_reentrant=False)) if self.checkpointed else (lambda f, h: f(h))
        return self.head(run(self._second, run(self._first, x)))


def test_dp_under_activation_checkpointing_keeps_no_activation_and_is_exact() -> None:
    """Checkpointed calls get their inputs from the re-run in backward (matched by region and
    order), so DP holds no checkpointed activation between forward and backward."""
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    target = torch.randn(6, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    results = []
    for checkpointed in (False, True):
        model = _Checkpointed(checkpointed).double()
        optimizer = DPSGD(model, lr=0.2, max_grad_norm=0.3, noise_multiplier=0.0)
        for _ in range(2):
            optimizer.zero_grad()
            loss = (model(x) - target).pow(2).sum(1).mean()
            gc.collect()
            alive = sum(ref() is not None for ref in model.watched)
            assert alive == (0 if checkpointed else 3)
            loss.backward()
            optimizer.step()
            model.watched = []
        results.append([p.detach().clone() for p in model.parameters()])
    for plain, checkpointed in zip(*results, strict=True):
        torch.testing.assert_close(plain, checkpointed, rtol=1e-12, atol=1e-14)
