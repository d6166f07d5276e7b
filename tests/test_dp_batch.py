"""DP never refuses a correct model, never accepts a broadcast one: whether a layer's call holds the samples is
told by the computation (``Capture.follow_samples``), not by sizes that happen to agree.

Each correct model here is exact at every batch size against per-sample gradients from ``torch.func`` in float64
(clipped and averaged); each broadcast use of a layer is refused before any change, whatever the batch size."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call, grad, vmap

from inputaware_optim import DPSGD

EXPANDED, REPEATED, FLAT, ROW = "expanded", "repeated", "(T,)", "(1, T)"
CORRECT, BROADCAST = (EXPANDED, REPEATED), (FLAT, ROW)


def positions(how: str, batch: int, length: int) -> torch.Tensor:
    """Position ids ``torch.arange(length)``: per sample (expanded or repeated to the batch) or broadcast."""
    ids = torch.arange(length)
    shaped = {EXPANDED: lambda: ids.expand(batch, length), REPEATED: lambda: ids.repeat(batch, 1)}
    return shaped.get(how, lambda: ids if how == FLAT else ids[None])()


class TokensAndPositions(nn.Module):
    """nanoGPT's embeddings: token ids ``(B, 6)`` plus learned positions, then a head."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos, self.head = nn.Embedding(10, 4), nn.Embedding(6, 4), nn.Linear(4, 3)
        self.how = how

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.tok(ids) + self.pos(positions(self.how, *ids.shape))))


class ViT(nn.Module):
    """A ViT on ``(B, 3, 8, 8)`` images: 4 patches (a strided ``Conv2d``, or a ``Linear`` on the unfolded
    patches), a class token parameter expanded to the batch, 5 learned positions, one pre-norm attention block."""

    def __init__(self, how: str, patches: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Conv2d(3, 8, 4, stride=4) if patches == "Conv2d" else nn.Linear(48, 8)
        self.cls = nn.Parameter(0.5 * torch.randn(1, 1, 8))
        self.pos, self.norm, self.qkv = nn.Embedding(5, 8), nn.LayerNorm(8), nn.Linear(8, 24)
        self.proj, self.head = nn.Linear(8, 8), nn.Linear(8, 2)
        self.how = how

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        batch = images.shape[0]
        if isinstance(self.patch, nn.Conv2d):
            h = self.patch(images).flatten(2).transpose(1, 2)
        else:
            unfolded = images.unfold(2, 4, 4).unfold(3, 4, 4).permute(0, 2, 3, 1, 4, 5)
            h = self.patch(unfolded.reshape(batch, 4, 48))
        h = torch.cat([self.cls.expand(batch, -1, -1), h], dim=1)
        h = h + self.pos(positions(self.how, batch, 5))
        q, k, v = self.qkv(self.norm(h)).chunk(3, dim=-1)
        attention = (q @ k.transpose(1, 2) / math.sqrt(8)).softmax(-1)
        return self.head((h + self.proj(attention @ v))[:, 0])


class TokenFeatures(nn.Module):
    """``(B, 5, 6)`` token features through ``Linear`` layers, plus learned positions."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.pos = nn.Linear(6, 4), nn.Embedding(5, 4)
        self.mix, self.head = nn.Linear(4, 4), nn.Linear(4, 2)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x) + self.pos(positions(self.how, *x.shape[:2])))
        return self.head(torch.tanh(self.mix(h)).mean(1))


def _ids(batch: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 10, (batch, 6), generator=generator)


def _images(batch: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch, 3, 8, 8, generator=generator, dtype=torch.float64)


def _features(batch: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch, 5, 6, generator=generator, dtype=torch.float64)


# Each pattern: the model for a way of passing positions, and a batch of its inputs.
PATTERNS: dict[str, tuple[Callable[[str], nn.Module], Callable[[int, torch.Generator], torch.Tensor]]] = {
    "tokens (B, 6)": (TokensAndPositions, _ids),
    "ViT, Conv2d patches": (lambda how: ViT(how, "Conv2d"), _images),
    "ViT, Linear patches": (lambda how: ViT(how, "Linear"), _images),
    "token features (B, 5, 6)": (TokenFeatures, _features),
}
# The batch sizes that equal another dimension of a pattern's input (or its positions): refused before.
COINCIDENT = {
    "tokens (B, 6)": (6,),
    "ViT, Conv2d patches": (3, 8, 5),
    "ViT, Linear patches": (3, 8, 5),
    "token features (B, 5, 6)": (5, 6),
}


def clipped_reference(model: nn.Module, x: torch.Tensor, clip: float) -> dict[str, torch.Tensor]:
    """The noise-free DP-SGD step of ``mean_i |model(x_i)|²``: each sample's gradient (``torch.func``, float64),
    clipped to ``clip``, averaged."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_of_one(p: dict[str, torch.Tensor], one: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (one[None],)).pow(2).sum()

    per_sample = vmap(grad(loss_of_one), in_dims=(None, 0))(params, x)
    norms = torch.sqrt(sum(g.reshape(len(x), -1).pow(2).sum(1) for g in per_sample.values()))
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    return {k: torch.tensordot(factors, g, dims=1) / len(x) for k, g in per_sample.items()}


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).flatten(1).sum(1).mean()


def assert_exact_step(model: nn.Module, x: torch.Tensor, clip: float = 0.05) -> None:
    """One noise-free step of DPSGD (lr 1) moves every parameter by the reference's clipped mean."""
    expected = clipped_reference(model, x, clip)
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=clip, noise_multiplier=0.0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    _loss(model, x).backward()
    optimizer.step()
    for key, param in model.named_parameters():
        torch.testing.assert_close(before[key] - param.detach(), expected[key], rtol=1e-9, atol=1e-12, msg=key)


def assert_refused_before_any_change(model: nn.Module, optimizer: DPSGD, x: torch.Tensor, named: str) -> None:
    """The step raises, naming the layer and saying nothing changed: parameters and state are as they were."""
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(optimizer.state_dict())
    optimizer.zero_grad()
    _loss(model, x).backward()
    with pytest.raises(RuntimeError, match=rf"\b{named}\b.*No parameter was changed"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
    _assert_same(state, optimizer.state_dict())


def _assert_same(a: Any, b: Any) -> None:
    """Bitwise equality of two state dicts (tensors, numbers, nested containers)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def at_coincident_sizes(ways: tuple[str, ...]) -> Callable[[Any], Any]:
    """Every batch size that equals another dimension of a pattern, as explicit examples besides hypothesis's."""

    def decorate(test: Any) -> Any:
        for pattern, sizes in COINCIDENT.items():
            for batch in sizes:
                for how in ways:
                    test = example(pattern=pattern, batch=batch, how=how)(test)
        return test

    return decorate


@at_coincident_sizes(CORRECT)
@given(pattern=st.sampled_from(list(PATTERNS)), batch=st.integers(1, 16), how=st.sampled_from(CORRECT))
def test_positions_per_sample_are_accepted_and_exact_at_every_batch_size(pattern: str, batch: int, how: str) -> None:
    # Refused before whenever the batch equaled another dimension of the model's input (a ViT on (B, 3, 8, 8)
    # at B = 3 and 8, (B, 5, 6) features at B = 5 and 6): the sizes could not tell positions expanded to the
    # batch from positions broadcast over it. Under Poisson sampling a long run met such a batch and stopped.
    make, inputs = PATTERNS[pattern]
    assert_exact_step(make(how).double(), inputs(batch, torch.Generator().manual_seed(batch)))


@at_coincident_sizes(BROADCAST)
@given(pattern=st.sampled_from(list(PATTERNS)), batch=st.integers(1, 16), how=st.sampled_from(BROADCAST))
def test_positions_broadcast_over_the_samples_are_refused_before_any_change(pattern: str, batch: int, how: str) -> None:
    make, inputs = PATTERNS[pattern]
    x = inputs(batch, torch.Generator().manual_seed(batch))
    if batch == 1 and how == ROW:
        # One sample: positions of shape (1, T) are the expanded ones, the same computation, and exact.
        assert_exact_step(make(how).double(), x)
        return
    model = make(EXPANDED).double()
    optimizer = DPSGD(
        model,
        lr=0.1,
        momentum=0.9,
        max_grad_norm=0.05,
        noise_multiplier=1.0,
        generator=torch.Generator().manual_seed(0),
    )
    _loss(model, x).backward()
    optimizer.step()  # (so there is state to keep: momentum, the noise generator's, the privacy history)
    model.how = how  # the same model, its positions now broadcast over the samples
    assert_refused_before_any_change(model, optimizer, x, "pos")


class RelativeBias(nn.Module):
    """Attention with a learned bias of the relative positions, as T5's: the bias layer is called on ``(T, T)``
    buckets and its output broadcast over the samples' ``(B, T, T)`` scores, or on buckets expanded to the batch."""

    def __init__(self, expand: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qk, self.bias, self.head = nn.Linear(4, 8), nn.Embedding(9, 1), nn.Linear(4, 2)
        self.expand = expand

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        buckets = torch.arange(length)[None] - torch.arange(length)[:, None] + 4  # (T, T)
        bias = self.bias(buckets.expand(batch, length, length) if self.expand else buckets).squeeze(-1)
        q, k = self.qk(x).chunk(2, dim=-1)
        return self.head((q @ k.transpose(1, 2) + bias).softmax(-1) @ x).mean(1)


@pytest.mark.parametrize("batch", [5, 3])
def test_a_bias_broadcast_over_the_attention_scores_is_refused_and_exact_expanded(batch: int) -> None:
    x = torch.randn(batch, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    model = RelativeBias(expand=False).double()
    assert_refused_before_any_change(model, DPSGD(model, lr=0.1, noise_multiplier=0.0), x, "bias")
    assert_exact_step(RelativeBias(expand=True).double(), x)


class Queries(nn.Module):
    """Learned queries, computed from a parameter (``tanh``), through a layer: broadcast over the samples, or
    expanded to the batch before the call."""

    def __init__(self, expand: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.proj = nn.Linear(3, 3), nn.Linear(3, 3)
        self.queries = nn.Parameter(torch.randn(4, 3))
        self.expand = expand

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        queries = self.queries.tanh()
        return (self.inp(x) * self.proj(queries.expand(x.shape[0], 4, 3) if self.expand else queries)).sum(2)


def test_a_layer_on_a_tensor_computed_from_parameters_is_refused_when_its_rows_pass_for_samples() -> None:
    # 4 queries and a batch of 4: each query's gradient, summed over the samples, was clipped as a sample's
    # (the layer's input was no parameter itself, nor indices, so no check saw it).
    x = torch.randn(4, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    model = Queries(expand=False).double()
    assert_refused_before_any_change(model, DPSGD(model, lr=0.1, noise_multiplier=0.0), x, "proj")
    assert_exact_step(Queries(expand=True).double(), x)


class PositionsArgument(nn.Module):
    """Token ids and position ids, both arguments of the model (Hugging Face's ``position_ids``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos, self.head = nn.Embedding(10, 4), nn.Embedding(6, 4), nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.tok(ids) + self.pos(position_ids)))


def test_position_ids_passed_to_the_model_are_refused_broadcast_and_exact_per_sample() -> None:
    ids = torch.randint(0, 10, (6, 6), generator=torch.Generator().manual_seed(0))  # batch 6, context 6
    model = PositionsArgument().double()
    optimizer = DPSGD(model, lr=0.1, noise_multiplier=0.0)
    model(ids, torch.arange(6)).pow(2).flatten(1).sum(1).mean().backward()
    with pytest.raises(RuntimeError, match=r"^pos is called with indices of shape \(6,\).*No parameter was changed"):
        optimizer.step()

    expanded = torch.arange(6).expand(6, 6)
    params = {k: v.detach() for k, v in model.named_parameters()}
    per_sample = vmap(
        grad(lambda p, one, at: functional_call(model, p, (one[None], at[None])).pow(2).sum()), in_dims=(None, 0, 0)
    )(params, ids, expanded)
    norms = torch.sqrt(sum(g.reshape(6, -1).pow(2).sum(1) for g in per_sample.values()))
    factors = (0.05 / (norms + 1e-6)).clamp(max=1.0)
    model = PositionsArgument().double()  # (a fresh optimizer: the one that refused keeps the refused forward)
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.05, noise_multiplier=0.0)
    model(ids, expanded).pow(2).flatten(1).sum(1).mean().backward()
    optimizer.step()
    for key, param in model.named_parameters():
        expected = torch.tensordot(factors, per_sample[key], dims=1) / 6
        torch.testing.assert_close(params[key] - param.detach(), expected, rtol=1e-9, atol=1e-12, msg=key)


def test_a_compiled_forward_falls_back_to_the_sizes_and_says_so() -> None:
    # Compiled code is not followed (the mode would be traced): the sizes decide, as before, and the refusal
    # says why a correct model may be refused there.
    torch._dynamo.reset()
    model = TokensAndPositions(FLAT).double()
    optimizer = DPSGD(model, lr=0.1, noise_multiplier=0.0)
    compiled = torch.compile(model, backend="eager")
    _loss(compiled, torch.randint(0, 10, (6, 6))).backward()
    with pytest.raises(RuntimeError, match=r"^pos is called with indices.*ran compiled.*No parameter was changed"):
        optimizer.step()


class Beside(nn.Module):
    """A position table whose output leaves the forward beside the model's output, to meet the samples in the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.pos = nn.Linear(6, 2), nn.Embedding(5, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.body(x).mean(1), self.pos(torch.arange(5))


def test_a_layer_whose_output_never_meets_the_samples_in_the_forward_is_judged_by_the_sizes() -> None:
    model = Beside().double()
    optimizer = DPSGD(model, lr=0.1, noise_multiplier=0.0)
    out, side = model(torch.randn(5, 5, 6, dtype=torch.float64))
    (out + side.sum(0)).pow(2).sum(1).mean().backward()
    with pytest.raises(RuntimeError, match=r"^pos is called with indices.*never met the samples within the forward"):
        optimizer.step()
