"""Layer kinds against explicit math: grouped convolutions (FOOF, K-FAC, NLMS, DP), EmbeddingBag
with offsets and per-sample weights (DP, LazyAdamW), and the layers no rule covers, reported by name."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from inputaware_optim import DPSGD, FOOF, KFAC, NLMS, Eva, LazyAdamW
from inputaware_optim.coverage import supported_layers_table

GROUPED = {
    "conv1d groups=2": lambda: nn.Conv1d(4, 6, 3, groups=2, padding=1),
    "conv2d depthwise": lambda: nn.Conv2d(4, 4, 3, groups=4, stride=2, padding="valid"),
    "conv2d groups=2 dilated reflect": lambda: nn.Conv2d(
        4, 6, 3, groups=2, dilation=2, padding=2, padding_mode="reflect"
    ),
    "conv2d groups=2 few positions": lambda: nn.Conv2d(8, 8, 3, groups=2),  # DP's ghost norm
    "conv3d groups=2 no bias": lambda: nn.Conv3d(2, 4, 2, groups=2, bias=False),
}
SPATIAL = {
    "conv1d groups=2": (7,),
    "conv2d depthwise": (7, 7),
    "conv2d groups=2 dilated reflect": (6, 5),
    "conv2d groups=2 few positions": (3, 4),
}


def grouped(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    conv = GROUPED[name]().double()
    x = torch.randn(3, conv.in_channels, *SPATIAL.get(name, (3, 4, 3)), dtype=torch.float64)
    return conv, x


def explicit_rows(conv: nn.Module, x: torch.Tensor, group: int) -> torch.Tensor:
    """Group ``group``'s patch rows, one per (sample, output position), by slicing out every window."""
    assert isinstance(conv, nn.modules.conv._ConvNd)
    channels = conv.in_channels // conv.groups
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    x = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)[:, group * channels : (group + 1) * channels]
    spatial = x.shape[2:]
    ranges = [
        range((n - d * (k - 1) - 1) // s + 1)
        for n, k, s, d in zip(spatial, conv.kernel_size, conv.stride, conv.dilation, strict=True)
    ]
    rows = []
    for b in range(x.shape[0]):
        for position in torch.cartesian_prod(*[torch.tensor(list(r)) for r in ranges]).reshape(-1, len(ranges)):
            window = tuple(
                slice(int(p) * s, int(p) * s + d * (k - 1) + 1, d)
                for p, k, s, d in zip(position, conv.kernel_size, conv.stride, conv.dilation, strict=True)
            )
            rows.append(x[(b, slice(None), *window)].reshape(-1))
    return torch.stack(rows)


def block(conv: nn.Module, group: int, with_bias: bool) -> tuple[torch.Tensor, slice]:
    """Group ``group``'s weight-and-bias gradient as a matrix, and its output channels."""
    out = conv.out_channels // conv.groups
    channels = slice(group * out, (group + 1) * out)
    matrix = conv.weight.grad[channels].reshape(out, -1)
    if with_bias:
        matrix = torch.cat([matrix, conv.bias.grad[channels, None]], dim=1)
    return matrix, channels


def inverse(matrix: torch.Tensor, damping: float) -> torch.Tensor:
    return torch.linalg.inv(matrix + damping * torch.eye(matrix.shape[0], dtype=matrix.dtype))


@pytest.mark.parametrize("rule", ["FOOF", "KFAC", "NLMS"])
@pytest.mark.parametrize("name", list(GROUPED))
def test_grouped_convolution_is_preconditioned_block_by_block(name: str, rule: str) -> None:
    conv, x = grouped(name)
    twin, _ = grouped(name)
    has_bias = conv.bias is not None
    output = twin(x)
    output.retain_grad()
    output.pow(2).mean().backward()
    g = output.grad
    expected_weight, expected_bias = twin.weight.detach().clone(), None if not has_bias else twin.bias.detach().clone()
    for j in range(conv.groups):
        rows = explicit_rows(twin, x, j)
        rows = torch.cat([rows, torch.ones(len(rows), 1, dtype=rows.dtype)], 1) if has_bias else rows
        matrix, channels = block(twin, j, has_bias)
        if rule == "FOOF":
            new = matrix @ inverse(rows.T @ rows / len(rows), 0.1)
        elif rule == "KFAC":
            grads = g[:, channels].movedim(1, -1).reshape(-1, channels.stop - channels.start)
            factor, inputs = len(x) * grads.T @ grads, rows.T @ rows / len(rows)
            pi = (inputs.trace() / len(inputs) / (factor.trace() / len(factor))).sqrt()  # each block its own
            new = inverse(factor, 0.1**0.5 / pi) @ matrix @ inverse(inputs, 0.1**0.5 * pi)
        else:
            new = matrix / (1e-6 + rows.pow(2).sum() / len(rows))
        expected_weight[channels] -= new[:, : matrix.shape[1] - has_bias].reshape(expected_weight[channels].shape)
        if has_bias:
            expected_bias[channels] -= new[:, -1]
    optimizer = {"FOOF": FOOF, "KFAC": KFAC, "NLMS": NLMS}[rule](conv, lr=1.0, momentum=0.0)
    conv(x).pow(2).mean().backward()
    optimizer.step()
    assert "stock" not in optimizer.coverage()[0].treatment
    torch.testing.assert_close(conv.weight.detach(), expected_weight, rtol=1e-10, atol=1e-12)
    if has_bias:
        torch.testing.assert_close(conv.bias.detach(), expected_bias, rtol=1e-10, atol=1e-12)
    if rule != "NLMS":
        assert optimizer.rules[0].state[conv.weight]["input_second_moment"].shape[0] == conv.groups


@pytest.mark.parametrize("name", ["conv2d depthwise", "conv1d groups=2"])
def test_eva_on_a_grouped_convolution_is_one_rank_one_product_per_block(name: str) -> None:
    conv, x = grouped(name)
    twin, _ = grouped(name)
    output = twin(x)
    output.retain_grad()
    output.pow(2).mean().backward()
    expected_weight, expected_bias = twin.weight.detach().clone(), twin.bias.detach().clone()
    for j in range(conv.groups):
        rows = explicit_rows(twin, x, j)
        rows = torch.cat([rows, torch.ones(len(rows), 1, dtype=rows.dtype)], 1)
        matrix, channels = block(twin, j, True)
        a = rows.mean(0)
        g = output.grad[:, channels].movedim(1, -1).reshape(-1, channels.stop - channels.start).sum(0)
        kronecker = torch.kron(torch.outer(g, g), torch.outer(a, a))  # damped as a whole (row-major vec)
        identity = torch.eye(len(kronecker), dtype=kronecker.dtype)
        new = torch.linalg.solve(kronecker + 0.03 * identity, matrix.reshape(-1)).reshape(matrix.shape)
        expected_weight[channels] -= new[:, :-1].reshape(expected_weight[channels].shape)
        expected_bias[channels] -= new[:, -1]
    optimizer = Eva(conv, lr=1.0, momentum=0.0, kl_clip=None)
    conv(x).pow(2).mean().backward()
    optimizer.step()
    assert optimizer.rules[0].state[conv.weight]["input_mean"].shape[0] == conv.groups
    torch.testing.assert_close(conv.weight.detach(), expected_weight, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(conv.bias.detach(), expected_bias, rtol=1e-9, atol=1e-10)


def clipped_reference(model: nn.Module, x: torch.Tensor, clip: float) -> dict[str, torch.Tensor]:
    params = {k: v.detach() for k, v in model.named_parameters()}
    per_sample = vmap(grad(lambda p, xi: functional_call(model, p, (xi[None],)).pow(2).sum()), in_dims=(None, 0))(
        params, x
    )
    norms = torch.sqrt(sum(g.reshape(len(x), -1).pow(2).sum(1) for g in per_sample.values()))
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    return {k: torch.tensordot(factors, g, dims=1) / len(x) for k, g in per_sample.items()}


@pytest.mark.parametrize("name", list(GROUPED))
def test_dp_on_grouped_convolutions_equals_per_sample_clipping(name: str) -> None:
    conv, x = grouped(name)
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.LazyLinear(2)).double()
    model(x)  # materializes the lazy head
    expected = clipped_reference(model, x, clip=0.05)
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.05, noise_multiplier=0.0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    model(x).pow(2).sum(1).mean().backward()
    optimizer.step()
    assert "closed form for Conv" in optimizer.coverage()[0].treatment
    for key, param in model.named_parameters():
        torch.testing.assert_close(before[key] - param.detach(), expected[key], rtol=1e-8, atol=1e-12, msg=key)


# -- EmbeddingBag -------------------------------------------------------------------------------

INDICES = torch.tensor([1, 2, 4, 5, 0, 4, 3, 2, 9, 7])
OFFSETS = torch.tensor([0, 4, 4, 7])  # bag 1 is empty


@pytest.mark.parametrize(
    "mode, weighted, padding, last",
    [("sum", True, None, False), ("sum", False, 0, True), ("mean", False, 0, False), ("mean", False, None, True)],
)
def test_dp_on_embedding_bags_with_offsets_equals_one_bag_at_a_time(
    mode: str, weighted: bool, padding: int | None, last: bool
) -> None:
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(10, 3, mode=mode, padding_idx=padding, include_last_offset=last).double()
    offsets = torch.cat([OFFSETS, torch.tensor([len(INDICES)])]) if last else OFFSETS
    weights = torch.rand(len(INDICES), dtype=torch.float64) if weighted else None
    bags = len(OFFSETS)
    target = torch.randn(bags, 3, dtype=torch.float64)
    ends = [*OFFSETS[1:].tolist(), len(INDICES)]
    per_sample = []
    for b, (start, end) in enumerate(zip(OFFSETS.tolist(), ends, strict=True)):  # one bag, one call
        bag.zero_grad()
        one_offsets = torch.tensor([0, end - start] if last else [0])
        one = bag(INDICES[start:end], one_offsets, None if weights is None else weights[start:end])
        (one - target[b]).pow(2).sum().backward()
        per_sample.append(bag.weight.grad.clone())
    stacked = torch.stack(per_sample)
    factors = (0.1 / (stacked.reshape(bags, -1).norm(dim=1) + 1e-6)).clamp(max=1.0)
    expected = torch.tensordot(factors, stacked, dims=1) / bags
    bag.zero_grad()
    optimizer = DPSGD(bag, lr=1.0, max_grad_norm=0.1, noise_multiplier=0.0)
    before = bag.weight.detach().clone()
    (bag(INDICES, offsets, per_sample_weights=weights) - target).pow(2).sum(1).mean().backward()
    optimizer.step()
    torch.testing.assert_close(before - bag.weight.detach(), expected, rtol=1e-10, atol=1e-12)


def test_lazy_adamw_moves_only_the_rows_the_bags_read() -> None:
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(12, 3, mode="sum", padding_idx=0)
    optimizer = LazyAdamW(bag, lr=0.1)
    before = bag.weight.detach().clone()
    bag(INDICES, OFFSETS, per_sample_weights=torch.rand(len(INDICES))).pow(2).sum().backward()
    optimizer.step()
    moved = (bag.weight != before).any(1).nonzero().flatten().tolist()
    assert moved == sorted(set(INDICES.tolist()) - {0})


# -- layers no rule covers: reported by name ----------------------------------------------------


@pytest.mark.filterwarnings("ignore::inputaware_optim.UncapturedInputsWarning")
@pytest.mark.parametrize("rule", ["FOOF", "NLMS"])
@pytest.mark.parametrize("cross, batch_first", [(False, True), (True, True), (True, False)])
def test_multihead_attention_in_proj_is_three_blocks_on_query_key_and_value(
    rule: str, cross: bool, batch_first: bool
) -> None:
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(4, 2, batch_first=batch_first).double()
    twin = nn.MultiheadAttention(4, 2, batch_first=batch_first).double()
    twin.load_state_dict(attention.state_dict())
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 5, 4, dtype=torch.float64, generator=generator)
    memory = torch.randn(3, 7, 4, dtype=torch.float64, generator=generator) if cross else query
    if not batch_first:
        query, memory = query.transpose(0, 1), memory.transpose(0, 1)
    twin(query, memory, memory)[0].pow(2).mean().backward()
    expected_weight, expected_bias = twin.in_proj_weight.detach().clone(), twin.in_proj_bias.detach().clone()
    for j, x in enumerate((query, memory, memory)):
        rows = torch.cat([x.reshape(-1, 4), torch.ones(x.numel() // 4, 1, dtype=x.dtype)], 1)
        block = slice(4 * j, 4 * j + 4)
        matrix = torch.cat([twin.in_proj_weight.grad[block], twin.in_proj_bias.grad[block, None]], 1)
        if rule == "FOOF":
            new = matrix @ inverse(rows.T @ rows / len(rows), 0.1)
        else:
            new = matrix / (1e-6 + rows.pow(2).sum() / len(rows))
        expected_weight[block] -= new[:, :4]
        expected_bias[block] -= new[:, 4]
    optimizer = {"FOOF": FOOF, "NLMS": NLMS}[rule](attention, lr=1.0, momentum=0.0)
    attention(query, memory, memory)[0].pow(2).mean().backward()
    optimizer.step()
    torch.testing.assert_close(attention.in_proj_weight.detach(), expected_weight, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(attention.in_proj_bias.detach(), expected_bias, rtol=1e-10, atol=1e-12)
    rows = {row.name: row for row in optimizer.coverage()}
    assert not rows["in_proj_weight"].treatment.startswith("stock")
    assert rows["out_proj.weight"].fallback and "without calling out_proj" in (rows["out_proj.weight"].reason or "")


def test_kronecker_rules_with_output_gradients_report_multihead_attention_by_reason() -> None:
    attention = nn.MultiheadAttention(4, 2, batch_first=True)
    for rule in (KFAC, Eva):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reasons = {row.name: row.reason or "" for row in rule(attention, lr=0.1).coverage()}
        assert "MultiheadAttention has no output grad rows" in reasons["in_proj_weight"]


def test_kronecker_rules_without_lr_name_themselves() -> None:
    for rule in (FOOF, KFAC):
        with pytest.raises(TypeError, match=rf"^{rule.__name__}\(model, lr=\.\.\.\)"):
            rule(nn.Linear(2, 2))


def test_dp_refuses_what_it_cannot_clip_by_module_name() -> None:
    class Recurrent(nn.Module):
        def __init__(self, cls: type[nn.RNNBase]) -> None:
            super().__init__()
            self.encoder = cls(3, 4, batch_first=True)

    for cls in (nn.LSTM, nn.GRU, nn.RNN):
        with pytest.raises(ValueError, match=rf"encoder \({cls.__name__}\).*opacus\.layers\.DPLSTM"):
            DPSGD(Recurrent(cls))
    with pytest.raises(ValueError, match=r"0 \(LSTMCell\).*fused recurrent kernel"):
        DPSGD(nn.Sequential(nn.LSTMCell(3, 4)))
    weight_norm = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(3, 2)))
    with pytest.raises(ValueError, match=r"0 \(ParametrizedLinear\).*parametrization.*remove_parametrizations"):
        DPSGD(weight_norm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        old_style = nn.Sequential(nn.utils.weight_norm(nn.Linear(3, 2)))
    with pytest.raises(ValueError, match=r"0 \(Linear\).*weight_g, weight_v.*remove_weight_norm"):
        DPSGD(old_style)
    with pytest.raises(ValueError, match="batch_dim"):
        DPSGD(nn.Linear(2, 2), batch_dim=2)
    with pytest.raises(ValueError, match=r"0 \(EmbeddingBag\): scale_grad_by_freq=True.*depends on the others"):
        DPSGD(nn.Sequential(nn.EmbeddingBag(5, 2, scale_grad_by_freq=True)))


def test_dp_on_opacus_dplstm_equals_per_sample_clipping() -> None:
    layers = pytest.importorskip("opacus.layers")

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.encoder, self.head = layers.DPLSTM(3, 4, batch_first=True), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(x)[0][:, -1])

    model = Recurrent().double()
    x = torch.randn(3, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = clipped_reference(model, x, clip=0.05)
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.05, noise_multiplier=0.0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    model(x).pow(2).sum(1).mean().backward()
    optimizer.step()
    for key, param in model.named_parameters():
        torch.testing.assert_close(before[key] - param.detach(), expected[key], rtol=1e-8, atol=1e-12, msg=key)


class SequenceFirst(nn.Module):
    """A sequence-first model, as those built on nn.Transformer's default: token ids (T, B) throughout."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mix, self.head = nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids)))).mean(0)


class BatchFirstOutside(nn.Module):
    """Takes (B, T) and hands the sequence-first model (T, B): every layer sees T along dim 0."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = SequenceFirst()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids.T)


def test_dp_refuses_to_clip_per_time_step_and_is_exact_with_batch_dim_1() -> None:
    ids = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(0))  # (B, T)
    model = BatchFirstOutside().double()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.05, noise_multiplier=0.0)
    model(ids).pow(2).sum(1).mean().backward()
    with pytest.raises(RuntimeError, match=r"hold 5 samples along dim 0.*has \[3\].*batch_dim=1"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))

    inner = model.inner
    params = {k: v.detach() for k, v in inner.named_parameters()}
    per_sample = vmap(grad(lambda p, one: functional_call(inner, p, (one[:, None],)).pow(2).sum()), in_dims=(None, 0))(
        params, ids
    )
    norms = torch.sqrt(sum(g.reshape(3, -1).pow(2).sum(1) for g in per_sample.values()))
    factors = (0.05 / (norms + 1e-6)).clamp(max=1.0)
    optimizer = DPSGD(inner, lr=1.0, max_grad_norm=0.05, noise_multiplier=0.0, batch_dim=1)
    inner.zero_grad()
    inner(ids.T).pow(2).sum(1).mean().backward()
    optimizer.step()
    for (key, param), old in zip(inner.named_parameters(), before, strict=True):
        expected = torch.tensordot(factors, per_sample[key], dims=1) / 3
        torch.testing.assert_close(old - param.detach(), expected, rtol=1e-8, atol=1e-12, msg=key)


def test_epsilon_is_opacus_accountant_on_the_steps_taken() -> None:
    accountants = pytest.importorskip("opacus.accountants")
    model = nn.Linear(3, 1)
    optimizer = DPSGD(model, lr=0.1, noise_multiplier=1.1, sample_rate=0.01)
    assert optimizer.epsilon(1e-5) == 0.0
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
    for mechanism in ("rdp", "prv"):
        reference = accountants.create_accountant(mechanism)
        for _ in range(3):
            reference.step(noise_multiplier=1.1, sample_rate=0.01)
        assert optimizer.epsilon(1e-5, accountant=mechanism) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-9)
    resumed = DPSGD(model, lr=0.1, noise_multiplier=1.1, sample_rate=0.01)
    resumed.load_state_dict(optimizer.state_dict())
    assert resumed.epsilon(1e-5, "rdp") == optimizer.epsilon(1e-5, "rdp")
    with pytest.raises(ValueError, match="sample_rate"):
        DPSGD(model).epsilon(1e-5)


# -- the README's "Supported layers" table -------------------------------------------------------

README = Path(__file__).resolve().parent.parent / "README.md"
TABLE = re.compile(r"<!-- supported-layers:[^\n]*-->\n(.*?)\n<!-- end supported-layers -->", re.DOTALL)


def test_readme_supported_layers_table_is_the_registrys() -> None:
    found = TABLE.search(README.read_text())
    assert found, "README.md lost its supported-layers markers"
    assert found.group(1) == supported_layers_table(), (
        "README.md's Supported layers table is stale: paste the output of "
        "python -c 'from inputaware_optim.coverage import supported_layers_table as t; print(t())'"
    )


def instances() -> dict[str, nn.Module]:
    """One small module per registered built-in type, by the name the table gives it."""
    made: dict[str, nn.Module] = {
        "`nn.Linear`": nn.Linear(3, 2),
        "`nn.Conv1d`": nn.Conv1d(2, 2, 1),
        "`nn.Conv2d`": nn.Conv2d(2, 2, 1, groups=2),
        "`nn.Conv3d`": nn.Conv3d(2, 2, 1),
        "`nn.ConvTranspose1d`": nn.ConvTranspose1d(2, 2, 1),
        "`nn.ConvTranspose2d`": nn.ConvTranspose2d(2, 2, 1),
        "`nn.ConvTranspose3d`": nn.ConvTranspose3d(2, 2, 1),
        "`nn.MultiheadAttention`": nn.MultiheadAttention(4, 2),
        "`nn.NonDynamicallyQuantizableLinear`": nn.modules.linear.NonDynamicallyQuantizableLinear(4, 4),
        "`nn.Embedding`": nn.Embedding(5, 2),
        "`nn.EmbeddingBag`": nn.EmbeddingBag(5, 2),
        "`nn.LayerNorm`": nn.LayerNorm(3),
    }
    try:
        from transformers.pytorch_utils import Conv1D

        made["`transformers.pytorch_utils.Conv1D` (by name)"] = Conv1D(2, 3)
    except ImportError:
        pass
    return made


def test_each_cell_of_the_table_is_what_the_optimizers_report() -> None:
    rows = [line.split(" | ") for line in supported_layers_table().splitlines()[2:]]
    cells = {name: row[1:] for row in rows for name in row[0].lstrip("| ").split(", ")}
    made = instances()
    assert {name for name in cells if name.startswith("`")} >= set(made)
    for name, module in made.items():
        weight = module.in_proj_weight if isinstance(module, nn.MultiheadAttention) else module.weight
        model = nn.ModuleList([module])
        columns = ((FOOF, 0), (KFAC, 1), (Eva, 1), (NLMS, 2), (LazyAdamW, 3))
        for rule, cell in ((rule, cells[name][column]) for rule, column in columns):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row = next(r for r in rule(model, lr=0.1).coverage() if r.shape == tuple(weight.shape))
            expected = {"exact": (False, False), "stock": (True, False), "stock, reported": (True, True)}[cell]
            assert (row.treatment.startswith("stock"), row.fallback) == expected, (name, rule.__name__, row)
        dp = cells[name][4].rstrip(" |")
        if dp == "refused":
            with pytest.raises(ValueError, match="cannot compute per-sample gradients"):
                DPSGD(model)
            continue
        row = next(r for r in DPSGD(model).coverage() if r.shape == tuple(weight.shape))
        assert ("closed form" in row.treatment) == (dp == "exact (closed form)"), (name, row)


def test_dp_refuses_multihead_attention_by_name_and_opacus_drop_in_is_exact() -> None:
    model = nn.Sequential(nn.MultiheadAttention(4, 2, batch_first=True))
    with pytest.raises(ValueError, match=r"of 0 \(MultiheadAttention\): its out_proj.*DPMultiheadAttention"):
        DPSGD(model, lr=0.1)
    layers = pytest.importorskip("opacus.layers")

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.attention, self.head = layers.DPMultiheadAttention(4, 2, batch_first=True), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.attention(x, x, x)[0].mean(1))

    model = Attention().double()
    x = torch.randn(3, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = clipped_reference(model, x, clip=0.05)
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.05, noise_multiplier=0.0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    model(x).pow(2).sum(1).mean().backward()
    optimizer.step()
    for key, param in model.named_parameters():
        torch.testing.assert_close(before[key] - param.detach(), expected[key], rtol=1e-8, atol=1e-12, msg=key)


@pytest.mark.parametrize(
    "layer",
    [lambda: nn.ConvTranspose1d(2, 3, 3, stride=2), lambda: nn.ConvTranspose2d(4, 4, 3, stride=2, groups=2, padding=1)],
    ids=["1d", "2d grouped"],
)
def test_dp_on_transposed_convolutions_is_exact_through_torch_func(layer: Any) -> None:
    torch.manual_seed(0)
    conv = layer().double()
    x = torch.randn(3, conv.in_channels, *([4] * (conv.weight.dim() - 2)), dtype=torch.float64)
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.LazyLinear(2)).double()
    model(x)
    expected = clipped_reference(model, x, clip=0.05)
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.05, noise_multiplier=0.0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    model(x).pow(2).sum(1).mean().backward()
    optimizer.step()
    assert "torch.func" in optimizer.coverage()[0].treatment
    for key, param in model.named_parameters():
        torch.testing.assert_close(before[key] - param.detach(), expected[key], rtol=1e-8, atol=1e-12, msg=key)


# -- a user's layer type, registered once, joins every rule ------------------------------------


class MyLinear(nn.Module):
    """A linear layer that is not an nn.Linear (a user's own type, say from another package)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(weight.clone()), nn.Parameter(bias.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@pytest.mark.parametrize("rule", [FOOF, KFAC, NLMS, Eva, DPSGD], ids=lambda c: c.__name__)
def test_registering_a_kind_for_a_new_layer_makes_every_rule_use_it(rule: type) -> None:
    from inputaware_optim import register_layer
    from inputaware_optim.layers import _REGISTRY, LinearKind

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    mine = nn.Sequential(
        MyLinear(reference[0].weight.detach(), reference[0].bias.detach()),
        nn.Tanh(),
        MyLinear(reference[2].weight.detach(), reference[2].bias.detach()),
    )
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    settings = {"lr": 0.5, "max_grad_norm": 0.1, "noise_multiplier": 0.0} if rule is DPSGD else {"lr": 0.5}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unregistered = rule(mine, **settings)
    assert all(row.treatment.startswith("stock") for row in unregistered.coverage() if rule is not DPSGD)
    del unregistered  # its hooks go with it
    register_layer(MyLinear)(type("MyLinearKind", (LinearKind,), {}))
    try:
        results = []
        for model in (reference, mine):
            optimizer = rule(model, **settings)
            model(x).pow(2).sum(1).mean().backward()
            optimizer.step()
            treatments = [row.treatment for row in optimizer.coverage()]
            results.append([p.detach().clone() for p in model.parameters()])
        assert not any(t.startswith("stock") for t in treatments), treatments
        if rule is DPSGD:
            assert all("closed form for MyLinear" in t for t in treatments)
        for got, expected in zip(results[1], results[0], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    finally:
        del _REGISTRY[MyLinear]


# -- transposed convolutions: the convolution they equal ---------------------------------------

TRANSPOSED = {
    "1d stride 3 dilated": (lambda: nn.ConvTranspose1d(2, 3, 3, stride=3, dilation=2, padding=1), (6,), None),
    "2d grouped output padding": (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, padding=1, output_padding=1),
        (4, 5),
        None,
    ),
    "2d output_size given": (lambda: nn.ConvTranspose2d(2, 2, 2, stride=2, bias=False), (3, 3), (7, 7)),
    "3d": (lambda: nn.ConvTranspose3d(2, 2, 2, stride=(1, 2, 1), padding=(0, 1, 0)), (2, 3, 2), None),
}


def equivalent_convolution(
    transposed: nn.Module, x: torch.Tensor, output_size: tuple[int, ...] | None
) -> tuple[nn.Module, torch.Tensor]:
    """The ordinary convolution a transposed one equals, and its input: ``stride - 1`` zeros between
    input elements, ``dilation * (kernel - 1) - padding`` padded around (more at the end for the
    output padding), weight transposed per group and flipped."""
    assert isinstance(transposed, nn.modules.conv._ConvTransposeNd)
    spatial = x.dim() - 2
    sizes = [(n - 1) * s + 1 for n, s in zip(x.shape[2:], transposed.stride, strict=True)]
    up = torch.zeros(*x.shape[:2], *sizes, dtype=x.dtype)
    for index in torch.cartesian_prod(*[torch.arange(n) for n in x.shape[2:]]).reshape(-1, spatial).tolist():
        up[(slice(None), slice(None), *[i * s for i, s in zip(index, transposed.stride, strict=True)])] = x[
            (slice(None), slice(None), *index)
        ]
    expected_output = transposed(x, output_size=output_size) if output_size else transposed(x)
    pads = []
    for d in reversed(range(spatial)):
        k, p, dil = transposed.kernel_size[d], transposed.padding[d], transposed.dilation[d]
        before = dil * (k - 1) - p
        after = expected_output.shape[2 + d] - (up.shape[2 + d] + before - dil * (k - 1))
        pads += [before, after]
    up = F.pad(up, pads)
    conv_type = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[spatial]
    groups = transposed.groups
    conv = conv_type(
        transposed.in_channels,
        transposed.out_channels,
        transposed.kernel_size,
        dilation=transposed.dilation,
        groups=groups,
        bias=transposed.bias is not None,
    ).double()
    w = transposed.weight.detach().reshape(groups, -1, *transposed.weight.shape[1:]).transpose(1, 2)
    with torch.no_grad():
        conv.weight.copy_(w.flip(list(range(3, 3 + spatial))).reshape(conv.weight.shape))
        if conv.bias is not None:
            conv.bias.copy_(transposed.bias)
    torch.testing.assert_close(conv(up), expected_output.detach(), rtol=1e-12, atol=1e-12)
    return conv, up


@pytest.mark.parametrize("rule", [FOOF, KFAC, NLMS, Eva], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", list(TRANSPOSED))
def test_transposed_convolution_takes_the_step_of_the_convolution_it_equals(name: str, rule: type) -> None:
    make, spatial, output_size = TRANSPOSED[name]
    torch.manual_seed(0)
    transposed = make().double()
    x = torch.randn(3, transposed.in_channels, *spatial, dtype=torch.float64)
    conv, up = equivalent_convolution(transposed, x, output_size)
    settings = {"lr": 1.0, "momentum": 0.0}
    for layer, inputs, kwargs in ((transposed, x, {"output_size": output_size} if output_size else {}), (conv, up, {})):
        optimizer = rule(layer, **settings)
        layer(inputs, **kwargs).pow(2).mean().backward()
        optimizer.step()
        assert not optimizer.coverage()[0].treatment.startswith("stock")
    w = transposed.weight.detach().reshape(transposed.groups, -1, *transposed.weight.shape[1:]).transpose(1, 2)
    as_conv = w.flip(list(range(3, 3 + len(spatial)))).reshape(conv.weight.shape)
    torch.testing.assert_close(as_conv, conv.weight.detach(), rtol=1e-10, atol=1e-12)
    if conv.bias is not None:
        torch.testing.assert_close(transposed.bias.detach(), conv.bias.detach(), rtol=1e-10, atol=1e-12)


def test_dp_with_batch_dim_1_leaves_arguments_shared_by_the_batch_in_place() -> None:
    """A layer called with (T, B, D) and a (T, T) mask (not batched): the mask is not moved."""

    class Mixing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return torch.einsum("st,tbd,ed->sbe", mask, x, self.weight)  # mixes positions, never samples

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.mix, self.head = Mixing(), nn.Linear(4, 2).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = torch.tril(torch.ones(x.shape[0], x.shape[0], dtype=x.dtype))
            return self.head(torch.tanh(self.mix(x, mask))).mean(0)

    model = Model()
    x = torch.randn(5, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))  # (T, B, D)
    params = {k: v.detach() for k, v in model.named_parameters()}
    per_sample = vmap(grad(lambda p, one: functional_call(model, p, (one[:, None],)).pow(2).sum()), in_dims=(None, 1))(
        params, x
    )
    norms = torch.sqrt(sum(g.reshape(3, -1).pow(2).sum(1) for g in per_sample.values()))
    factors = (0.05 / (norms + 1e-6)).clamp(max=1.0)
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=0.05, noise_multiplier=0.0, batch_dim=1)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    model(x).pow(2).sum(1).mean().backward()
    optimizer.step()
    for key, param in model.named_parameters():
        expected = torch.tensordot(factors, per_sample[key], dims=1) / 3
        torch.testing.assert_close(before[key] - param.detach(), expected, rtol=1e-8, atol=1e-12, msg=key)


def test_dp_batch_check_ignores_evaluation_forwards_and_compiled_ones() -> None:
    """An eval forward (no grad, another batch size) before compiled training steps refuses nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    twin = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    twin.load_state_dict(model.state_dict())
    optimizer = DPSGD(model, lr=0.5, max_grad_norm=0.1, noise_multiplier=0.0)
    reference = DPSGD(twin, lr=0.5, max_grad_norm=0.1, noise_multiplier=0.0)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        model(torch.randn(7, 3))
    x = torch.randn(4, 3)
    for net, opt in ((compiled, optimizer), (twin, reference)):
        for _ in range(2):
            opt.zero_grad()
            net(x).pow(2).sum(1).mean().backward()
            opt.step()
    for got, expected in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(got, expected)
