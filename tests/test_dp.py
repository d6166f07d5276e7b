"""DP-SGD / DP-AdamW against per-sample gradients from torch.func.vmap(grad), one sample at a time."""

from __future__ import annotations

import gc
import math
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


class Listed(nn.Module):
    """Weights in an ``nn.ParameterList`` (never called) or registered on the module that uses them."""

    def __init__(self, listed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        weights = [nn.Parameter(torch.randn(20, 4, dtype=torch.float64)), nn.Parameter(torch.randn(4, 3).double())]
        if listed:
            self.weights = nn.ParameterList(weights)
        else:
            self.first, self.second = weights

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        first, second = self.weights if hasattr(self, "weights") else (self.first, self.second)
        return torch.tanh(first[tokens]).mean(1) @ second


def test_a_layer_on_a_packed_sequences_data_is_refused_its_rows_are_tokens() -> None:
    """``packed.data`` stacks the tokens of every sequence (12 rows for 4 sequences): each row clipped as a
    sample would bound a token, not a sequence. The model's input counts as the padded batch it packs."""
    from torch.nn.utils.rnn import pack_padded_sequence

    class OnPacked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 1)

        def forward(self, packed: Any) -> torch.Tensor:
            return self.linear(packed.data).sum()

    model = OnPacked()
    packed = pack_padded_sequence(torch.randn(4, 5, 3), torch.tensor([5, 4, 2, 1]), batch_first=True)
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=4)
    model(packed).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"hold 12 samples .*\(it has \[4\]\).*PackedSequence's .data"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_a_parameter_list_is_refused_saying_where_to_register_them_and_that_is_exact() -> None:
    tokens, target = data(4, seed=1)
    model = Listed(listed=True)
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.05, noise_multiplier=0.0)
    (model(tokens) - target).pow(2).sum(1).mean().backward()
    with pytest.raises(RuntimeError, match=r"weights holds them but is never called: register them on the module"):
        optimizer.step()
    model = Listed(listed=False)
    expected = per_sample_clipped_mean(model, tokens, target, 0.05)
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.05, noise_multiplier=0.0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    (model(tokens) - target).pow(2).sum(1).mean().backward()
    optimizer.step()
    for name, param in model.named_parameters():
        torch.testing.assert_close(before[name] - param.detach(), expected[name], rtol=1e-9, atol=1e-12)


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


def clipped_reference(model: nn.Module, x: torch.Tensor, clip: float) -> dict[str, torch.Tensor]:
    """The noise-free DP-SGD gradient of ``mean_i |model(x_i)|²`` from torch.func's per-sample gradients."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_of_one(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (xi[None],)).pow(2).sum()

    per_sample = vmap(grad(loss_of_one), in_dims=(None, 0))(params, x)
    norms = torch.sqrt(sum(g.reshape(len(x), -1).pow(2).sum(1) for g in per_sample.values()))
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    return {k: torch.tensordot(factors, g, dims=1) / len(x) for k, g in per_sample.items()}


def assert_step_is_clipped_mean(model: nn.Module, x: torch.Tensor, clip: float = 0.05) -> None:
    expected = clipped_reference(model, x, clip)
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=clip, noise_multiplier=0.0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    model(x).pow(2).flatten(1).sum(1).mean().backward()
    optimizer.step()
    for key, param in model.named_parameters():
        torch.testing.assert_close(before[key] - param.detach(), expected[key], rtol=1e-9, atol=1e-12, msg=key)


class _Twice(nn.Module):
    """One layer called twice in a forward, on inputs of different sizes."""

    def __init__(self, layer: nn.Module, shrink: nn.Module) -> None:
        super().__init__()
        self.layer, self.shrink = layer, shrink

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layer(x)).flatten(1).sum(1, keepdim=True) + self.layer(self.shrink(x)).flatten(1)


# Per-sample weight gradients are formed (many positions for the layer's size) or take the ghost norm
# (few positions); convolutions form theirs with their own weight-gradient kernel, batched as groups.
CONVOLUTIONS = {
    "conv2d formed": (nn.Conv2d(3, 4, 3, padding=1), (5, 3, 8, 8)),
    "conv2d ghost": (nn.Conv2d(16, 16, 3, padding=1), (5, 16, 2, 2)),
    "conv2d strided dilated unpadded": (nn.Conv2d(3, 4, 3, stride=2, dilation=2), (5, 3, 11, 9)),
    "conv2d ghost strided": (nn.Conv2d(16, 8, 3, stride=2, padding=1, bias=False), (5, 16, 3, 3)),
    "conv2d same (uneven)": (nn.Conv2d(3, 4, (2, 4), padding="same"), (5, 3, 6, 7)),
    "conv2d reflect": (nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (5, 3, 6, 6)),
    "conv2d circular ghost": (nn.Conv2d(16, 16, 3, padding=1, padding_mode="circular"), (5, 16, 2, 2)),
    "conv1d formed": (nn.Conv1d(3, 4, 3, padding=2, dilation=2), (5, 3, 9)),
    "conv1d ghost": (nn.Conv1d(32, 16, 3, stride=2, padding=1), (5, 32, 3)),
    "conv3d formed": (nn.Conv3d(2, 3, 2, padding=1), (5, 2, 3, 4, 3)),
    "conv3d ghost": (nn.Conv3d(8, 8, 3, padding=1), (5, 8, 1, 2, 1)),
}


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("name", list(CONVOLUTIONS))
def test_convolutions_equal_per_sample_clipping(name: str) -> None:
    torch.manual_seed(0)
    conv, shape = CONVOLUTIONS[name]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.LazyLinear(2)).double()
    model(x)  # materializes the lazy head
    assert_step_is_clipped_mean(model, x)


@pytest.mark.parametrize(
    ("layer", "positions"),
    [
        (nn.Linear(2, 3), 9),  # many positions for its size: formed
        (nn.Linear(12, 12), 3),  # few positions: the ghost norm
        (nn.Linear(12, 5, bias=False), 2),
        (nn.Linear(12, 5), 1),  # one position: |g|² |x|²
    ],
    ids=["formed", "ghost", "ghost without bias", "one position"],
)
def test_sequence_linear_equals_per_sample_clipping(layer: nn.Module, positions: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, positions, layer.in_features, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert_step_is_clipped_mean(nn.Sequential(layer, nn.Tanh()).double(), x)


@pytest.mark.parametrize(
    "norm",
    [nn.LayerNorm(6), nn.LayerNorm(6, bias=False), nn.LayerNorm((3, 6)), nn.LayerNorm(6, elementwise_affine=False)],
    ids=["affine", "without bias", "two dims", "no parameters"],
)
def test_layer_norm_closed_form_equals_per_sample_clipping(norm: nn.Module) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 5, 3, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():  # weights away from their initial ones and zeros, so every term counts
        for param in norm.parameters():
            param.normal_()
    model = nn.Sequential(nn.Linear(6, 6), norm, nn.Tanh()).double()
    assert_step_is_clipped_mean(model, x)


@pytest.mark.parametrize(
    ("layer", "shape"),
    [
        (nn.Conv2d(16, 16, 3, padding=1), (4, 16, 6, 6)),  # formed at 6x6, the ghost norm at 2x2
        (nn.Linear(16, 16), (4, 3, 16)),  # the ghost norm, on both calls' rows side by side
    ],
    ids=["conv formed and ghost", "linear"],
)
def test_a_layer_called_twice_on_different_sizes(layer: nn.Module, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    shrink = nn.AdaptiveAvgPool2d(2) if isinstance(layer, nn.Conv2d) else nn.Identity()
    model = _Twice(layer, shrink).double()
    assert_step_is_clipped_mean(model, x)


def test_noise_is_drawn_in_place_with_the_same_stream() -> None:
    """The private gradient written into ``.grad`` (float32, in place) equals the clipped mean plus
    the generator's ``randn`` for each parameter in turn, times ``sigma * C / B``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(5))
    clip, sigma = 0.05, 1.3
    expected = clipped_reference(model, x, clip)
    optimizer = DPSGD(
        model, lr=1.0, max_grad_norm=clip, noise_multiplier=sigma, generator=torch.Generator().manual_seed(9)
    )
    model(x).pow(2).sum(1).mean().backward()
    grads = {id(p): p.grad for p in model.parameters()}
    optimizer.step()
    stream = torch.Generator().manual_seed(9)
    for key, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=stream) * (sigma * clip / len(x))
        assert param.grad is grads[id(param)]  # written in place
        torch.testing.assert_close(param.grad, expected[key] + noise, rtol=1e-4, atol=1e-6, msg=key)


def test_a_huge_convolution_gradient_is_clipped_in_float64() -> None:
    """Per-sample gradients formed in float32 whose squares overflow: their norms are taken again in
    float64, so each sample is clipped to C rather than to nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Flatten(), nn.Linear(3 * 16, 1))
    x = torch.randn(4, 2, 4, 4, generator=torch.Generator().manual_seed(6))
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=1.0, noise_multiplier=0.0)
    (model(x).sum() * 1e19).backward()
    optimizer.step()
    update_norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
    assert 0.5 < update_norm <= 1.0 + 1e-4  # four samples, each clipped to 1 (mostly aligned): mean norm near 1


def test_coverage_names_the_layer_norm_closed_form() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    treatments = {row.treatment for row in DPSGD(model, lr=0.1).coverage()}
    assert "DPSGD: per-sample clipping (closed form for LayerNorm)" in treatments


class _Positions(nn.Module):
    """nanoGPT's embeddings: tokens plus positions, ``torch.arange(T)`` or expanded to the batch."""

    def __init__(self, expand: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos, self.head = nn.Embedding(10, 4), nn.Embedding(6, 4), nn.Linear(4, 3)
        self.expand = expand

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1])
        return self.head(self.tok(idx) + self.pos(positions.expand(idx.shape) if self.expand else positions))


@pytest.mark.parametrize(
    ("batch", "named"), [(4, r"\{'pos': \[6\]\}"), (6, r"^pos is called with indices"), (1, r"\{'pos': \[6\]\}")]
)
def test_dp_refuses_positions_broadcast_over_the_samples_at_any_batch_size(batch: int, named: str) -> None:
    # At batch 6 (the context length) every layer agreed on 6 samples, and each position's gradient,
    # summed over the samples, was clipped as a sample's: the privacy bound held per position, silently.
    model = _Positions(expand=False).double()
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.05, noise_multiplier=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randint(0, 10, (batch, 6))).pow(2).flatten(1).sum(1).mean().backward()
    with pytest.raises(RuntimeError, match=named + r".*arange.*No parameter was changed"):
        optimizer.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_dp_with_positions_expanded_to_the_batch_is_exact_when_batch_equals_context() -> None:
    assert_step_is_clipped_mean(_Positions(expand=True).double(), torch.randint(0, 10, (6, 6)))


class _Queries(nn.Module):
    """Learned queries (a parameter of the model) through a layer, beside the batch."""

    def __init__(self, expand: bool, buffer: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.inp = nn.Linear(3, 3), nn.Linear(3, 3)
        if buffer:  # a memory bank
            self.register_buffer("queries", torch.randn(4, 3))
        else:
            self.queries = nn.Parameter(torch.randn(4, 3))
        self.expand = expand

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        queries = self.queries.expand(x.shape[0], 4, 3) if self.expand else self.queries
        return (self.inp(x) * self.proj(queries)).sum(2)


@pytest.mark.parametrize("buffer", [False, True], ids=["parameter", "buffer"])
def test_dp_refuses_a_layer_called_on_a_parameter_when_its_rows_pass_for_samples(buffer: bool) -> None:
    # With 4 queries and a batch of 4 the layer's rows passed for samples: each query's gradient,
    # summed over the batch, was clipped as a sample's. (The model owning a parameter itself also
    # skipped every batch check.) Expanded to the batch, it is exact.
    model = _Queries(expand=False, buffer=buffer).double()
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.05, noise_multiplier=0.0)
    model(torch.randn(4, 4, 3, dtype=torch.float64)).pow(2).flatten(1).sum(1).mean().backward()
    with pytest.raises(RuntimeError, match=r"proj is called on the model's tensor queries itself.*expand"):
        optimizer.step()
    assert_step_is_clipped_mean(_Queries(expand=True).double(), torch.randn(4, 4, 3, dtype=torch.float64))


class _OneAtATime(nn.Module):
    """A layer called on one sample at a time (its input without the batch dimension)."""

    def __init__(self, conv: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Conv2d(3, 2, 3) if conv else nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.layer(sample) for sample in x]).flatten(1)


@pytest.mark.parametrize("conv", [False, True], ids=["Linear", "Conv2d"])
def test_dp_refuses_a_layer_called_on_one_sample_at_a_time_and_is_exact_for_one(conv: bool) -> None:
    # A call without the batch dimension holds one sample, but DP counted its leading dimension as
    # samples: with a batch as large as the features (4) or the channels (3, RGB), each feature or
    # channel was clipped as a sample, silently.
    shape = (3, 5, 5) if conv else (4,)
    model = _OneAtATime(conv).double()
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.05, noise_multiplier=0.0)
    model(torch.randn(shape[0], *shape, dtype=torch.float64)).pow(2).sum(1).mean().backward()
    with pytest.raises(RuntimeError, match=r"called on one sample at a time.*No parameter was changed"):
        optimizer.step()
    assert_step_is_clipped_mean(_OneAtATime(conv).double(), torch.randn(1, *shape, dtype=torch.float64))


class _ZeroWidth(nn.Module):
    """A model with a zero-width layer beside the others: ``Linear(6, 0)`` (no outputs) or ``Linear(0, 4)``."""

    def __init__(self, width: tuple[int, int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.empty, self.head = nn.Linear(6, 4), nn.Linear(*width), nn.Linear(4, 2)
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = self.empty(x if self.width[0] == 6 else x[:, :0]).sum(1, keepdim=True)  # (B, 1): 0, or the bias
        return self.head(torch.tanh(self.body(x))) + side


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")  # (torch, constructing them)
@pytest.mark.parametrize("width", [(6, 0), (0, 4)], ids=["Linear(6, 0)", "Linear(0, 4)"])
def test_a_zero_width_linear_is_clipped_as_the_reference(width: tuple[int, int]) -> None:
    # Linear(6, 0) crashed the step ("cannot reshape tensor of 0 elements into shape [5, -1, 0]"): its
    # per-sample gradient is empty, and the step is the reference's, the empty layer's included.
    model = _ZeroWidth(width).double()
    assert_step_is_clipped_mean(model, torch.randn(5, 6, generator=torch.Generator().manual_seed(7)).double())
    model = _ZeroWidth(width).double()  # and with the noise on
    noisy = DPSGD(model, lr=0.1, max_grad_norm=0.05, noise_multiplier=1.0)
    model(torch.randn(5, 6, dtype=torch.float64)).pow(2).sum(1).mean().backward()
    noisy.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_model_compiled_with_fullgraph_is_refused_naming_dpsgd_and_what_to_do() -> None:
    # torch.compile(fullgraph=True) raised torch's generic "Skip calling `torch.compiler.disable()`d function"
    # (reason: None), naming neither DPSGD nor what to do. DP reads each forward's batch eagerly: a graph break.
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))
    optimizer = DPSGD(model, lr=0.1, max_grad_norm=0.1, noise_multiplier=0.0)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=r"DPSGD.*each forward's batch eagerly.*without fullgraph=True") as raised:
        compiled(torch.randn(5, 6))
    assert type(raised.value).__module__.startswith("torch._dynamo")  # torch's error, carrying DP's reason
    assert optimizer.privacy_history == []
