"""Real models from real packages (tiny random-weight configs, no downloads), and the layer patterns
of packages that cannot be installed here (timm: its torchvision wheels are CUDA builds)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from inputaware_optim import DPSGD, FOOF, KFAC, NLMS, CoverageWarning, InputAwareAdamW, LazyAdamW, Monitor

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, T, B = 40, 6, 3


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def bert() -> nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=2,
        num_attention_heads=2,
        hidden_size=16,
        intermediate_size=32,
        vocab_size=VOCAB,
        max_position_embeddings=16,
    )
    return transformers.BertForMaskedLM(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        hidden_size=16,
        intermediate_size=32,
        vocab_size=VOCAB,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


def t5() -> nn.Module:
    config = transformers.T5Config(
        num_layers=2,
        num_heads=2,
        d_model=16,
        d_kv=8,
        d_ff=32,
        vocab_size=VOCAB,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return transformers.T5ForConditionalGeneration(config)


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "bert": bert, "llama": llama, "t5": t5}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().double().eval()  # eval: no dropout, so steps are deterministic


def tokens(seed: int = 0, batch: int = B) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, T), generator=torch.Generator().manual_seed(seed))


def lm_loss(model: nn.Module, ids: torch.Tensor, **extra: Any) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, **extra).loss


def matrix_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every Linear and Hugging Face Conv1D: the weight matrices a Kronecker rule is for."""
    return {n: m for n, m in model.named_modules() if type(m).__name__ in ("Linear", "Conv1D")}


@pytest.mark.parametrize("rule", [FOOF, KFAC, NLMS], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", list(MODELS))
def test_kronecker_and_nlms_rules_act_on_every_weight_matrix(name: str, rule: type) -> None:
    model, stock_model = build(name), build(name)
    optimizer = rule(model, lr=0.05)
    stock = torch.optim.SGD(stock_model.parameters(), lr=0.05, momentum=0.0 if rule is NLMS else 0.9)
    for opt, m in ((optimizer, model), (stock, stock_model)):
        opt.zero_grad()
        lm_loss(m, tokens()).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CoverageWarning)
            opt.step()
    coverage = {row.name: row for row in optimizer.coverage()}
    tied = {n for n, m in matrix_layers(model).items() if m.weight is model.get_input_embeddings().weight}
    for module_name, module in matrix_layers(model).items():
        row = coverage.get(f"{module_name}.weight")
        if row is None:  # a weight registered first under another module (tied): reported there
            assert module_name in tied
            continue
        assert not row.treatment.startswith("stock"), (name, row)
        if rule is not NLMS:
            assert "input_second_moment" in optimizer.rules[0].state[module.weight], module_name
        changed = dict(model.named_parameters())[f"{module_name}.weight"]
        assert not torch.allclose(changed, dict(stock_model.named_parameters())[f"{module_name}.weight"])
    for row in optimizer.coverage().fallbacks():  # what is left: the embedding tables, each with its reason
        assert row.module == "Embedding" and row.reason, row


@pytest.mark.filterwarnings("ignore::inputaware_optim.CoverageWarning")
@pytest.mark.parametrize("rule", [KFAC, LazyAdamW], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_monitor_on_a_rule_logs_the_modules_it_logs_on_the_drop_in(name: str, rule: type) -> None:
    # K-FAC watches the Linear and Conv1D layers, LazyAdamW the embeddings: the Monitor on either
    # reads every module owning a trained parameter (LayerNorms, RMSNorms), as on InputAwareAdamW.
    logged = []
    for make in (InputAwareAdamW, rule):
        model = build(name)
        optimizer = make(model, lr=0.01)
        monitor = Monitor(optimizer)
        optimizer.zero_grad()
        lm_loss(model, tokens()).backward()
        optimizer.step()
        logged.append(monitor.last["modules"])
        monitor.remove()
    norms = {n for n, m in build(name).named_modules() if "Norm" in type(m).__name__}
    assert norms and norms <= set(logged[1])
    assert logged[1] == logged[0]


def test_conv1d_of_gpt2_matches_the_transposed_linear_reference() -> None:
    """FOOF on Hugging Face's Conv1D (weight (in, out)) is FOOF on the Linear with the transposed weight."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv1d = Conv1D(5, 4).double()
    linear = nn.Linear(4, 5).double()
    with torch.no_grad():
        linear.weight.copy_(conv1d.weight.T)
        linear.bias.copy_(conv1d.bias)
    x = torch.randn(3, T, 4, dtype=torch.float64)
    for layer in (conv1d, linear):
        optimizer = FOOF(layer, lr=0.5, update_every=1)
        layer(x).pow(2).sum().backward()
        optimizer.step()
    torch.testing.assert_close(conv1d.weight.T, linear.weight, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(conv1d.bias, linear.bias, rtol=1e-12, atol=1e-12)


def per_sample_grads(
    loss_of_one: Any, params: dict[str, torch.Tensor], *batched: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``torch.func.grad`` one sample at a time, stacked (Hugging Face's masking code branches on the
    position ids' values, which ``vmap`` cannot batch)."""
    grads = [grad(loss_of_one)(params, *(b[i] for b in batched)) for i in range(len(batched[0]))]
    return {k: torch.stack([g[k] for g in grads]) for k in params}


def clipped_reference(model: nn.Module, ids: torch.Tensor, clip: float, **extra: Any) -> dict[str, torch.Tensor]:
    """The textbook DP gradient (noise off): vmap(grad) per sample over the whole model, clipped, averaged."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_of_one(p: dict[str, torch.Tensor], one: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        kwargs = {k: v[None] for k, v in zip(extra, rest, strict=True)}
        return functional_call(model, p, (), {"input_ids": one[None], "labels": one[None], **kwargs}).loss

    per_sample = per_sample_grads(loss_of_one, params, ids, *extra.values())
    norms = torch.sqrt(sum(g.reshape(len(ids), -1).pow(2).sum(1) for g in per_sample.values()))
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    return {k: torch.tensordot(factors, g, dims=1) / len(ids) for k, g in per_sample.items()}


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_dp_on_language_models_equals_per_sample_clipping(name: str) -> None:
    model = build(name)
    ids = tokens(1)
    # The loss is a mean over every token of the batch; per sample, a mean over its own tokens:
    # with equal lengths, the batch loss is the mean of the samples' losses.
    extra = {"position_ids": torch.arange(T).expand(B, T)} if name in ("gpt2", "bert") else {}
    expected = clipped_reference(model, ids, clip=0.5, **extra)
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.5, noise_multiplier=0.0, momentum=0.0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    lm_loss(model, ids, **extra).backward()
    optimizer.step()
    # GPT-2's and Llama's attention paths keep parts in float32 even in a float64 model (their
    # batch gradient and the mean of vmap's per-sample gradients differ by 1.5e-7 relative,
    # before any clipping), so the reference itself is good to 1e-7 there; BERT's to 1e-15.
    rtol, atol = (1e-8, 1e-12) if name == "bert" else (1e-6, 1e-9)
    for key, param in model.named_parameters():
        torch.testing.assert_close(before[key] - param.detach(), expected[key], rtol=rtol, atol=atol, msg=key)


def test_dp_refuses_position_ids_broadcast_over_the_batch_by_name() -> None:
    model = build("gpt2")
    optimizer = DPSGD(model, lr=0.1, max_grad_norm=0.5, noise_multiplier=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    lm_loss(model, tokens()).backward()  # GPT-2 builds position ids of shape (1, T)
    with pytest.raises(RuntimeError, match=r"transformer\.wpe has a batch dimension of 1.*position_ids"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_kfac_max_dim_leaves_the_lm_head_to_sgd_and_says_so() -> None:
    model = build("llama")
    optimizer = KFAC(model, lr=0.05, max_dim=32)  # the untied head's output factor is 40 x 40
    lm_loss(model, tokens()).backward()
    with pytest.warns(CoverageWarning, match=r"lm_head\.weight.*max_dim=32"):
        optimizer.step()
    assert "output_grad_second_moment" not in optimizer.rules[0].state[model.lm_head.weight]
    assert "output_grad_second_moment" in optimizer.rules[0].state[model.model.layers[0].mlp.up_proj.weight]


def test_strict_refuses_any_fallback_before_changing_anything() -> None:
    model = build("gpt2")
    optimizer = FOOF(model, lr=0.05, strict=True)
    before = [p.detach().clone() for p in model.parameters()]
    lm_loss(model, tokens()).backward()
    with pytest.raises(RuntimeError, match=r"transformer\.wpe\.weight.*strict=True"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    table = str(optimizer.coverage())
    assert "transformer.h.0.attn.c_attn.weight" in table and "FOOF: Kronecker (Conv1D)" in table


# -- the layer patterns of timm (local definitions: timm itself needs torchvision) -------------


class StdConv2d(nn.Conv2d):
    """Weight standardization in forward, as timm's StdConv2d: not a plain Conv2d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        variance = w.var(dim=(1, 2, 3), keepdim=True, unbiased=False)
        w = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (variance + 1e-6).sqrt()
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class Conv2dSame(nn.Conv2d):
    """TensorFlow-style 'same' padding computed in forward, as timm's Conv2dSame."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ih, iw = x.shape[-2:]
        kh, kw = self.kernel_size
        ph = max((-(-ih // self.stride[0]) - 1) * self.stride[0] + kh - ih, 0)
        pw = max((-(-iw // self.stride[1]) - 1) * self.stride[1] + kw - iw, 0)
        x = F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2])
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class ConvNeXtBlock(nn.Module):
    """A ConvNeXt block: depthwise 7x7 conv, norm, pointwise MLP (GroupNorm for DP)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.GroupNorm(1, channels)
        self.pw1, self.pw2 = nn.Conv2d(channels, 2 * channels, 1), nn.Conv2d(2 * channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pw2(F.gelu(self.pw1(self.norm(self.dwconv(x)))))


class TimmLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = StdConv2d(1, 4, 3, stride=2)
        self.same = Conv2dSame(4, 4, 3, stride=2)
        self.block = ConvNeXtBlock(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.same(self.stem(x))).mean((2, 3)))


def test_subclasses_with_their_own_forward_are_reported_not_assumed_and_depthwise_convs_covered() -> None:
    model = TimmLike().double()
    optimizer = FOOF(model, lr=0.1)
    reasons = {row.name: row.reason or "" for row in optimizer.coverage()}
    assert "StdConv2d subclasses Conv2d with its own forward" in reasons["stem.weight"]
    assert "Conv2dSame subclasses Conv2d with its own forward" in reasons["same.weight"]
    assert reasons["block.dwconv.weight"] == ""  # depthwise: one factor per group
    assert reasons["block.pw1.weight"] == "" and reasons["head.weight"] == ""
    model(torch.randn(2, 1, 16, 16, dtype=torch.float64)).sum().backward()
    with pytest.warns(CoverageWarning, match="stem.weight"):
        optimizer.step()
    assert optimizer.rules[0].state[model.block.dwconv.weight]["input_second_moment"].shape == (4, 50, 50)


def test_dp_is_exact_on_timm_patterns() -> None:
    model = TimmLike().double()
    x = torch.randn(4, 1, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    params = {k: v.detach() for k, v in model.named_parameters()}
    per_sample = vmap(grad(lambda p, xi: functional_call(model, p, (xi[None],)).pow(2).sum()), in_dims=(None, 0))(
        params, x
    )
    norms = torch.sqrt(sum(g.reshape(4, -1).pow(2).sum(1) for g in per_sample.values()))
    factors = (0.05 / (norms + 1e-6)).clamp(max=1.0)
    expected = {k: torch.tensordot(factors, g, dims=1) / 4 for k, g in per_sample.items()}
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.05, noise_multiplier=0.0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    model(x).pow(2).sum(1).mean().backward()
    optimizer.step()
    for key, param in model.named_parameters():
        torch.testing.assert_close(before[key] - param.detach(), expected[key], rtol=1e-8, atol=1e-12, msg=key)


def test_dp_on_t5_refuses_its_unbatched_relative_bias_and_is_exact_once_it_is_frozen() -> None:
    """T5's relative_attention_bias is called with (T, T) position buckets whose output is broadcast
    over the batch (refused, by name); frozen, the rest (with the `shared` table, owned by a module
    never called, tied to both embeddings) equals per-sample clipping."""
    model, ids = build("t5"), tokens(1)
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.5, noise_multiplier=0.0, momentum=0.0)
    lm_loss(model, ids).backward()
    with pytest.raises(RuntimeError, match=r"relative_attention_bias'?: \[6\].*requires_grad_\(False\)"):
        optimizer.step()
    model.zero_grad()
    for name, param in model.named_parameters():
        param.requires_grad_("relative_attention_bias" not in name)
    trained = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}

    def loss_of_one(p: dict[str, torch.Tensor], one: torch.Tensor) -> torch.Tensor:
        return functional_call(model, {**p, **frozen}, (), {"input_ids": one[None], "labels": one[None]}).loss

    per_sample = vmap(grad(loss_of_one), in_dims=(None, 0))(trained, ids)
    norms = torch.sqrt(sum(g.reshape(B, -1).pow(2).sum(1) for g in per_sample.values()))
    factors = (0.5 / (norms + 1e-6)).clamp(max=1.0)
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.5, noise_multiplier=0.0, momentum=0.0)
    before = {k: v.detach().clone() for k, v in trained.items()}
    lm_loss(model, ids).backward()
    optimizer.step()
    for key, param in model.named_parameters():
        if key in trained:  # T5's attention keeps parts in float32 (as GPT-2's): the reference is good to 1e-7
            expected = torch.tensordot(factors, per_sample[key], dims=1) / B
            torch.testing.assert_close(before[key] - param.detach(), expected, rtol=1e-6, atol=1e-9, msg=key)


def test_dp_on_t5_refuses_its_relative_bias_when_the_batch_equals_the_length() -> None:
    # With as many samples as positions, the (T, T) buckets held as many rows as the batch and no size told them
    # from samples: each relative position's gradient, summed over the samples, was clipped as a sample's.
    model = build("t5")
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.5, noise_multiplier=0.0, momentum=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    lm_loss(model, tokens(1, batch=T)).backward()
    with pytest.raises(
        RuntimeError, match=r"relative_attention_bias is called with indices of shape \(6, 6\).*broadcast.*freeze"
    ):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_dp_on_bart_refuses_its_decoder_positions_broadcast_over_the_batch_by_name() -> None:
    # BART's decoder looks its positions up from cache_position, (1, T), while its first argument is the batch's
    # (B, T) ids: the sizes agreed, and the step failed inside vmap ("Expected all tensors to have the same size
    # in the mapped dimension, got sizes [3, 1]"). Frozen, the rest is taken.
    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config).double().eval()
    optimizer = DPSGD(model, lr=0.1, max_grad_norm=0.5, noise_multiplier=0.0, momentum=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    encoder_positions = model.model.encoder.embed_positions.weight.detach().clone()  # (B, T): per sample
    lm_loss(model, tokens()).backward()
    with pytest.raises(
        RuntimeError, match=r"^model\.decoder\.embed_positions is called .*broadcast over the samples.*freeze"
    ):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    model.model.decoder.embed_positions.requires_grad_(False)
    model.zero_grad()
    lm_loss(model, tokens()).backward()
    optimizer.step()
    assert not torch.equal(model.model.encoder.embed_positions.weight, encoder_positions)


# -- vision patterns: a ViT block and a ConvNeXt-style net, local definitions -----------------------


class ViTBlockNet(nn.Module):
    """Patch embedding (a strided conv), one pre-norm transformer block with nn.Linear attention (as
    timm's ViT), mean pooling and a head."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.patches = nn.Conv2d(1, dim, 4, stride=4)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patches(x).flatten(2).transpose(1, 2)  # (B, tokens, dim)
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = ((q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5).softmax(-1)
        h = h + self.proj((attention @ v).transpose(1, 2).reshape(b, t, d))
        h = h + self.fc2(F.gelu(self.fc1(self.norm2(h))))
        return self.head(h.mean(1))


class ConvNeXtNet(nn.Module):
    """A stem, two ConvNeXt blocks (depthwise 7x7, GroupNorm, pointwise MLP) and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(1, 8, 2, stride=2)
        self.blocks = nn.Sequential(ConvNeXtBlock(8), ConvNeXtBlock(8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


VISION = {"vit": ViTBlockNet, "convnext": ConvNeXtNet}


def images(seed: int = 0, batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rule", [FOOF, KFAC, NLMS], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", list(VISION))
def test_rules_act_on_every_weight_of_vision_nets(name: str, rule: type) -> None:
    model, stock_model = VISION[name]().double(), VISION[name]().double()
    optimizer = rule(model, lr=0.05, strict=True)  # every weight matrix covered: no fallback at all
    stock = torch.optim.SGD(stock_model.parameters(), lr=0.05, momentum=0.0 if rule is NLMS else 0.9)
    for opt, m in ((optimizer, model), (stock, stock_model)):
        m(images()).pow(2).mean().backward()
        opt.step()
    assert not optimizer.coverage().fallbacks()
    stock_params = dict(stock_model.named_parameters())
    for module_name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            if rule is not NLMS:
                assert "input_second_moment" in optimizer.rules[0].state[module.weight], module_name
            assert not torch.allclose(module.weight, stock_params[f"{module_name}.weight"]), module_name


@pytest.mark.parametrize("name", list(VISION))
def test_dp_on_vision_nets_equals_per_sample_clipping(name: str) -> None:
    model, x = VISION[name]().double(), images(1)
    params = {k: v.detach() for k, v in model.named_parameters()}
    per_sample = vmap(grad(lambda p, xi: functional_call(model, p, (xi[None],)).pow(2).sum()), in_dims=(None, 0))(
        params, x
    )
    norms = torch.sqrt(sum(g.reshape(len(x), -1).pow(2).sum(1) for g in per_sample.values()))
    factors = (0.05 / (norms + 1e-6)).clamp(max=1.0)
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.05, noise_multiplier=0.0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    model(x).pow(2).sum(1).mean().backward()
    optimizer.step()
    for key, param in model.named_parameters():
        expected = torch.tensordot(factors, per_sample[key], dims=1) / len(x)
        torch.testing.assert_close(before[key] - param.detach(), expected, rtol=1e-8, atol=1e-12, msg=key)


# -- Hugging Face's Trainer and Accelerate ------------------------------------------------------------


def language_data(name: str, count: int) -> list[dict[str, torch.Tensor]]:
    """Equal-length examples with position ids of their own (DP needs them batched), labels = inputs
    (GPT-2's first label is never a target: masked, so every count of target tokens agrees)."""
    ids = tokens(2, batch=count)
    labels = ids.clone()
    if name == "gpt2":
        labels[:, 0] = -100
    return [
        {"input_ids": i, "labels": label, "position_ids": torch.arange(T)} for i, label in zip(ids, labels, strict=True)
    ]


def trainer_arguments(tmp_path: Any, **overrides: Any) -> Any:
    settings = {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": B,
        "max_steps": 2,
        "learning_rate": 0.05,
        "report_to": [],
        "save_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
    }
    return transformers.TrainingArguments(**{**settings, **overrides})


def quiet(name: str) -> nn.Module:
    """A model without dropout (Trainer trains in train mode), in float64."""
    torch.manual_seed(0)
    model = MODELS[name]()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model.double()


def test_hf_trainer_runs_foof_with_gradient_accumulation_on_gpt2(tmp_path: Any) -> None:
    data = language_data("gpt2", 4 * B)
    models = {}
    for kind in ("foof", "stock"):
        model = quiet("gpt2")
        optimizer = (
            FOOF(model, lr=0.05, update_every=1)
            if kind == "foof"
            else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        )
        arguments = trainer_arguments(tmp_path / kind, gradient_accumulation_steps=2)
        trainer = transformers.Trainer(model=model, args=arguments, train_dataset=data, optimizers=(optimizer, None))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CoverageWarning)
            trainer.train()
        models[kind] = model
        if kind == "foof":
            assert optimizer.rules[0].state[model.transformer.h[0].attn.c_attn.weight]["statistics_steps"] == 2
            assert {row.module for row in optimizer.coverage().fallbacks()} == {"Embedding"}
    stock = dict(models["stock"].named_parameters())
    for key, param in models["foof"].named_parameters():
        if key.endswith("c_attn.weight") or key.endswith("c_fc.weight"):
            assert not torch.allclose(param, stock[key]), key


def test_hf_trainer_runs_dp_on_bert_and_equals_per_sample_clipping(tmp_path: Any) -> None:
    model = quiet("bert")
    data = language_data("bert", B)  # one step over the whole set: the clipped mean ignores the order
    batch = {k: torch.stack([d[k] for d in data]) for k in data[0]}
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_of_one(p: dict[str, torch.Tensor], ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return functional_call(
            model, p, (), {"input_ids": ids[None], "labels": ids[None], "position_ids": positions[None]}
        ).loss

    per_sample = per_sample_grads(loss_of_one, params, batch["input_ids"], batch["position_ids"])
    norms = torch.sqrt(sum(g.reshape(B, -1).pow(2).sum(1) for g in per_sample.values()))
    factors = (0.5 / (norms + 1e-6)).clamp(max=1.0)
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.5, noise_multiplier=0.0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    arguments = trainer_arguments(tmp_path, max_steps=1, learning_rate=1.0, max_grad_norm=0.0)  # DP clips itself
    transformers.Trainer(model=model, args=arguments, train_dataset=data, optimizers=(optimizer, None)).train()
    for key, param in model.named_parameters():
        expected = torch.tensordot(factors, per_sample[key], dims=1) / B
        torch.testing.assert_close(before[key] - param.detach(), expected, rtol=1e-8, atol=1e-12, msg=key)


@pytest.mark.parametrize("rule", ["FOOF", "DPSGD"])
def test_accelerate_prepare_and_accumulate_equal_one_step_on_the_whole_batch(rule: str) -> None:
    accelerate = pytest.importorskip("accelerate")
    x = torch.randn(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.randn(8, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2)).double()
        if rule == "FOOF":
            return model, FOOF(model, lr=0.5, update_every=1)
        return model, DPSGD(model, lr=0.5, max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=8)

    whole, optimizer = make()
    (whole(x) - y).pow(2).sum(1).mean().backward()
    optimizer.step()

    accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
    model, optimizer = make()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            accelerator.backward((model(inputs) - targets).pow(2).sum(1).mean())
            optimizer.step()
            optimizer.zero_grad()
    for got, expected in zip(model.parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
