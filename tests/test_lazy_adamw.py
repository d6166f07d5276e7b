"""LazyAdamW against SparseAdam and a row-wise AdamW reference; untouched rows stay bitwise."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from inputaware_optim import Call, CoverageWarning, InputAwareAdamW, LazyAdamW

VOCAB, DIM = 30, 4


class Bag(nn.Module):
    """An embedding followed by a linear head: a bag-of-words classifier."""

    def __init__(self, sparse: bool = False, padding_idx: int | None = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM, sparse=sparse, padding_idx=padding_idx)
        self.head = nn.Linear(DIM, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(dim=1))


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens).pow(2).mean()


def batches(count: int, seed: int = 0, high: int = VOCAB) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, high, (3, 5), generator=generator) for _ in range(count)]


def test_embedding_matches_sparse_adam_without_weight_decay() -> None:
    lazy_model, sparse_model = Bag(), Bag(sparse=True)
    # SparseAdam adds eps to sqrt(v) before bias correction, AdamW after: equal once eps is negligible.
    lazy = LazyAdamW(lazy_model, lr=0.01, eps=1e-12, weight_decay=0.0, params=lazy_model.embed.parameters())
    sparse = torch.optim.SparseAdam(sparse_model.embed.parameters(), lr=0.01, eps=1e-12)
    for tokens in batches(6, high=VOCAB // 2):  # half the table is never touched
        for model, optimizer in ((lazy_model, lazy), (sparse_model, sparse)):
            optimizer.zero_grad()
            loss_of(model, tokens).backward()
            optimizer.step()
    torch.testing.assert_close(lazy_model.embed.weight, sparse_model.embed.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        lazy.state[lazy_model.embed.weight]["exp_avg"], sparse.state[sparse_model.embed.weight]["exp_avg"]
    )


@given(rows=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), min_size=1, max_size=4))
def test_untouched_rows_and_their_moments_stay_bitwise(rows: list[list[int]]) -> None:
    model = Bag()
    optimizer = LazyAdamW(model, lr=0.1, weight_decay=0.1)
    touched: set[int] = set()
    for step_rows in rows:
        tokens = torch.tensor([step_rows])
        before = model.embed.weight.detach().clone()
        moments = {k: v.clone() for k, v in optimizer.state[model.embed.weight].items() if k != "step"}
        optimizer.zero_grad()
        loss_of(model, tokens).backward()
        optimizer.step()
        untouched = torch.tensor([r for r in range(VOCAB) if r not in step_rows])
        assert torch.equal(model.embed.weight[untouched], before[untouched])
        for key, value in moments.items():
            assert torch.equal(optimizer.state[model.embed.weight][key][untouched], value[untouched])
        touched.update(step_rows)
    never = [r for r in range(VOCAB) if r not in touched]
    if never:
        assert torch.equal(optimizer.state[model.embed.weight]["exp_avg"][never], torch.zeros(len(never), DIM))


def reference_rows(
    weight: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], rows: torch.Tensor, **h: Any
) -> None:
    """AdamW on ``rows`` only, written out as the textbook update with bias correction by the step count."""
    state["step"] = state.get("step", 0) + 1
    t = state["step"]
    for name in ("m", "v", "vmax"):
        state.setdefault(name, torch.zeros_like(weight))
    beta1, beta2 = h["betas"]
    for r in rows.tolist():
        g = -grad[r] if h["maximize"] else grad[r]
        weight[r] *= 1 - h["lr"] * h["weight_decay"]
        state["m"][r] = beta1 * state["m"][r] + (1 - beta1) * g
        state["v"][r] = beta2 * state["v"][r] + (1 - beta2) * g * g
        state["vmax"][r] = torch.maximum(state["vmax"][r], state["v"][r])
        v = state["vmax"][r] if h["amsgrad"] else state["v"][r]
        weight[r] -= h["lr"] / (1 - beta1**t) * state["m"][r] / ((v / (1 - beta2**t)).sqrt() + h["eps"])


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_touched_rows_follow_adamw(amsgrad: bool, maximize: bool) -> None:
    h = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.2, "amsgrad": amsgrad, "maximize": maximize}
    model = Bag()
    optimizer = LazyAdamW(model, **h)
    weight = model.embed.weight.detach().clone().double()
    state: dict[str, Any] = {}
    for tokens in batches(5, seed=1, high=20):
        optimizer.zero_grad()
        loss_of(model, tokens).backward()
        reference_rows(weight, model.embed.weight.grad.double(), state, torch.unique(tokens), **h)
        optimizer.step()
        torch.testing.assert_close(model.embed.weight.detach().double(), weight, rtol=1e-5, atol=1e-6)


def test_other_parameters_are_stock_adamw_bitwise() -> None:
    lazy_model, stock_model = Bag(), Bag()
    lazy = LazyAdamW(lazy_model, lr=0.01)
    stock = torch.optim.AdamW(stock_model.head.parameters(), lr=0.01)
    for tokens in batches(4):
        for model, optimizer in ((lazy_model, lazy), (stock_model, stock)):
            optimizer.zero_grad()
            loss_of(model, tokens).backward()
            optimizer.step()
        stock_model.embed.load_state_dict(lazy_model.embed.state_dict())  # same inputs to the head
    for p, q in zip(lazy_model.head.parameters(), stock_model.head.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("sparse", [False, True])
def test_padding_row_is_never_touched(sparse: bool) -> None:
    model = Bag(sparse=sparse, padding_idx=0)
    optimizer = LazyAdamW(model, lr=0.1, weight_decay=0.5)
    padding = model.embed.weight[0].detach().clone()
    for tokens in batches(3):
        tokens[:, -1] = 0
        optimizer.zero_grad()
        loss_of(model, tokens).backward()
        optimizer.step()
    assert torch.equal(model.embed.weight[0], padding)


def test_sparse_gradients_give_the_same_update_as_dense_ones() -> None:
    dense_model, sparse_model = Bag(), Bag(sparse=True)
    dense, sparse = LazyAdamW(dense_model, lr=0.05), LazyAdamW(sparse_model, lr=0.05)
    for tokens in batches(4):
        for model, optimizer in ((dense_model, dense), (sparse_model, sparse)):
            optimizer.zero_grad()
            loss_of(model, tokens).backward()
            optimizer.step()
    torch.testing.assert_close(dense_model.embed.weight, sparse_model.embed.weight)


def test_embedding_bag_with_offsets() -> None:
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(VOCAB, DIM, mode="sum")
    optimizer = LazyAdamW(bag, lr=0.1)
    before = bag.weight.detach().clone()
    indices, offsets = torch.tensor([1, 2, 4, 5, 4, 3]), torch.tensor([0, 2])
    bag(indices, offsets).pow(2).sum().backward()
    optimizer.step()
    changed = (bag.weight != before).any(dim=1).nonzero().squeeze(1)
    assert changed.tolist() == [1, 2, 3, 4, 5]


def test_a_tied_weight_is_updated_densely_like_adamw() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Embedding(VOCAB, DIM)
            self.out = nn.Linear(DIM, VOCAB, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.out(self.embed(tokens))

    lazy_model, stock_model = Tied(), Tied()
    lazy, stock = LazyAdamW(lazy_model, lr=0.01), InputAwareAdamW(stock_model, lr=0.01)
    for tokens in batches(3):
        for model, optimizer in ((lazy_model, lazy), (stock_model, stock)):
            optimizer.zero_grad()
            model(tokens).logsumexp(-1).mean().backward()
            optimizer.step()
    assert torch.equal(lazy_model.embed.weight, stock_model.embed.weight)


def test_gradient_accumulation_equals_the_concatenated_batch() -> None:
    a, b = Bag(), Bag()
    oa, ob = LazyAdamW(a, lr=0.05), LazyAdamW(b, lr=0.05)
    for step in range(3):
        micro = batches(3, seed=step)
        oa.zero_grad()
        for tokens in micro:
            (loss_of(a, tokens) / 3).backward()
        oa.step()
        ob.zero_grad()
        loss_of(b, torch.cat(micro)).backward()
        ob.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_state_dict_moves_to_stock_adamw_and_back() -> None:
    model = Bag()
    optimizer = LazyAdamW(model, lr=0.01)
    for tokens in batches(2):
        optimizer.zero_grad()
        loss_of(model, tokens).backward()
        optimizer.step()
    stock = torch.optim.AdamW(copy.deepcopy(model).parameters(), lr=0.01)
    stock.load_state_dict(optimizer.state_dict())
    back = LazyAdamW(model, lr=0.01)
    back.load_state_dict(stock.state_dict())
    for key, value in optimizer.state[model.embed.weight].items():
        assert torch.equal(back.state[model.embed.weight][key], value)
    assert math.isclose(float(back.state[model.embed.weight]["step"]), 2.0)


def test_unsupported_flags_and_no_embedding() -> None:
    with pytest.raises(ValueError, match="capturable"):
        LazyAdamW(Bag(), capturable=True)
    with pytest.warns(UserWarning, match=r"no nn\.Embedding"):
        LazyAdamW(nn.Linear(2, 2))


class _TiedFunctionalHead(nn.Module):
    """A table read by its module and again, without calling it, as an output head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.embed(tokens).mean(1), self.embed.weight)


def test_rows_with_gradient_from_a_functional_use_move_as_adamw_moves_them() -> None:
    torch.manual_seed(0)
    lazy_model = _TiedFunctionalHead()
    stock_model = copy.deepcopy(lazy_model)
    lazy = LazyAdamW(lazy_model, lr=0.05, weight_decay=0.0)
    stock = torch.optim.AdamW(stock_model.parameters(), lr=0.05, weight_decay=0.0, fused=True)
    for step in range(3):
        tokens = torch.randint(0, 30, (2, 3))
        for model, optimizer in ((lazy_model, lazy), (stock_model, stock)):
            optimizer.zero_grad()
            model(tokens).logsumexp(1).sum().backward()
        assert int(lazy_model.embed.weight.grad.ne(0).any(1).sum()) == 30  # every row has gradient
        if step == 0:
            with pytest.warns(CoverageWarning, match=r"rows of embed.weight got gradient that no captured call"):
                lazy.step()
        else:
            lazy.step()
        stock.step()
        torch.testing.assert_close(lazy_model.embed.weight, stock_model.embed.weight, rtol=0, atol=0)


def test_a_table_only_its_module_uses_is_proven_without_reading_the_gradient() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(40, 3), nn.Flatten(), nn.Linear(6, 1))
    optimizer = LazyAdamW(model, lr=0.1)
    tokens = torch.randint(0, 40, (5, 2))
    for _ in range(2):  # accumulation: each pass is proven on its own
        model(tokens).sum().backward()
    assert optimizer._rows.extra == {}  # the identity proof held: no pass read the whole gradient
    before = model[0].weight.detach().clone()
    optimizer.step()
    moved = (model[0].weight != before).any(1)
    assert torch.equal(moved.nonzero().squeeze(1), torch.unique(tokens))


def test_a_table_called_twice_in_one_pass_is_checked_and_needs_no_extra_rows() -> None:
    torch.manual_seed(0)
    embed = nn.Embedding(40, 3)
    model = nn.ModuleDict({"embed": embed})
    optimizer = LazyAdamW(model, lr=0.1)
    a, b = torch.randint(0, 40, (4,)), torch.randint(0, 40, (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CoverageWarning)
        (embed(a).sum() + embed(b).pow(2).sum()).backward()
        before = embed.weight.detach().clone()
        optimizer.step()
    moved = (embed.weight != before).any(1)
    assert torch.equal(moved.nonzero().squeeze(1), torch.unique(torch.cat([a, b])))


def _adamw_on_rows(weight: torch.Tensor, state: dict[str, Any], rows: torch.Tensor, **h: Any) -> dict[str, Any]:
    """Stock ``torch.optim.AdamW(fused=True)`` stepped once on a copy of ``rows`` (weight, gradient, state)."""
    theta = nn.Parameter(weight.detach()[rows].clone())
    theta.grad = weight.grad[rows].clone()
    stock = torch.optim.AdamW([theta], fused=True, **h)
    if state:
        rows_state = {k: v if k == "step" else v[rows].clone() for k, v in state.items()}
        stock.load_state_dict({"state": {0: rows_state}, "param_groups": stock.state_dict()["param_groups"]})
    stock.step()
    return {"weight": theta.detach(), **{k: v for k, v in stock.state[theta].items() if k != "step"}}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dim", [4, 6, 3, 64])  # rows of 16, 24, 12 and 256 bytes: each width the write-back takes
@pytest.mark.parametrize("amsgrad", [False, True])
def test_touched_rows_are_bitwise_stock_fused_adamw_on_the_gathered_rows(threads: int, dim: int, amsgrad: bool) -> None:
    h = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.2, "amsgrad": amsgrad, "maximize": amsgrad}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        embed = nn.Embedding(3000, dim)
        optimizer = LazyAdamW(embed, **h)
        generator = torch.Generator().manual_seed(1)
        for count in (5, 700, 2500, 40):  # few rows, and enough that the write-back is split over threads
            tokens = torch.randint(0, 3000, (count,), generator=generator)
            optimizer.zero_grad()
            embed(tokens).mul(torch.randn(count, dim, generator=generator)).sum().backward()
            rows = torch.unique(tokens)
            state = {k: v.clone() for k, v in optimizer.state[embed.weight].items()}
            expected = _adamw_on_rows(embed.weight, state, rows, **h)
            before = embed.weight.detach().clone()
            optimizer.step()
            after = optimizer.state[embed.weight]
            assert torch.equal(embed.weight[rows], expected["weight"])
            for key in ("exp_avg", "exp_avg_sq", *(["max_exp_avg_sq"] if amsgrad else [])):
                assert torch.equal(after[key][rows], expected[key]), key
            untouched = torch.ones(3000, dtype=torch.bool)
            untouched[rows] = False
            assert torch.equal(embed.weight[untouched], before[untouched])
    finally:
        torch.set_num_threads(previous)


def test_int32_token_ids_move_their_rows_as_fused_adamw_does() -> None:
    """nn.Embedding takes int32 ids too; the row write-back once required int64 ones."""
    h = {"lr": 0.05, "weight_decay": 0.1}
    torch.manual_seed(0)
    embed = nn.Embedding(VOCAB, DIM)
    optimizer = LazyAdamW(embed, **h)
    for tokens in batches(3, high=VOCAB // 2):
        tokens = tokens.to(torch.int32)
        optimizer.zero_grad()
        embed(tokens).pow(2).sum().backward()
        rows = torch.unique(tokens).long()
        state = {k: v.clone() for k, v in optimizer.state[embed.weight].items()}
        expected = _adamw_on_rows(embed.weight, state, rows, **h)
        optimizer.step()
        assert torch.equal(embed.weight[rows], expected["weight"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[embed.weight][key][rows], expected[key]), key


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
@pytest.mark.parametrize("width", [1, 3, 4, 6, 130])
@pytest.mark.parametrize("offset", [0, 1])
def test_row_write_back_copies_bits_unchanged(threads: int, dtype: torch.dtype, width: int, offset: int) -> None:
    """Any bit pattern (NaN payloads, subnormals, negative zero) lands unchanged, whatever width moves it."""
    from inputaware_optim.lazy_adamw import _write_rows

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(width + offset)
        itemsize = torch.empty((), dtype=dtype).element_size()

        def random_bits(count: int) -> torch.Tensor:
            return torch.randint(0, 256, (count * itemsize,), dtype=torch.uint8, generator=generator).view(dtype)

        table = random_bits(offset + 9000 * width)[offset:].view(9000, width)
        rows = torch.randperm(9000, generator=generator)[:8000]
        values = random_bits(8000 * width).view(8000, width)
        expected = table.clone().view(torch.uint8).view(9000, -1)
        expected[rows] = values.view(torch.uint8).view(8000, -1)
        _write_rows(table, rows, values)
        assert torch.equal(table.contiguous().view(torch.uint8).view(9000, -1), expected)
    finally:
        torch.set_num_threads(previous)


def test_a_table_without_captured_inputs_alone_gets_the_stock_dense_update() -> None:
    torch.manual_seed(0)
    lazy_embed = nn.Embedding(VOCAB, DIM)
    stock_embed = copy.deepcopy(lazy_embed)
    lazy, stock = LazyAdamW(lazy_embed, lr=0.1), torch.optim.AdamW(stock_embed.parameters(), lr=0.1)
    tokens = torch.tensor([1, 2, 3])
    for embed in (lazy_embed, stock_embed):
        embed(tokens).pow(2).sum().backward()
    lazy.step(inputs={})  # nothing captured for the table: it is not lazy this step
    stock.step()
    assert torch.equal(lazy_embed.weight, stock_embed.weight)


def test_hyperparameters_are_read_from_the_current_param_groups() -> None:
    """A scheduler's change of lr, and the groups load_state_dict puts in place, apply from the next step."""
    a, b = Bag(), Bag()
    oa, ob = LazyAdamW(a, lr=0.01), LazyAdamW(b, lr=0.3, betas=(0.5, 0.6))
    steps = batches(4)
    for model, optimizer in ((a, oa), (b, ob)):
        optimizer.zero_grad()
        loss_of(model, steps[0]).backward()
        optimizer.step()
    b.load_state_dict(a.state_dict())
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))  # b's groups are now a's: lr 0.01, the default betas
    for tokens in steps[1:]:
        for model, optimizer in ((a, oa), (b, ob)):
            optimizer.param_groups[0]["lr"] *= 0.5
            optimizer.zero_grad()
            loss_of(model, tokens).backward()
            optimizer.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_sparse_gradient_with_strided_values_gives_the_dense_update() -> None:
    """The fused kernel reads its tensors flat: strided values must reach it as a contiguous copy."""
    dense_model, sparse_model = Bag(), Bag(sparse=True)
    dense, sparse = LazyAdamW(dense_model, lr=0.05), LazyAdamW(sparse_model, lr=0.05)
    tokens = torch.tensor([[1, 4, 7]])
    loss_of(dense_model, tokens).backward()
    grad = dense_model.embed.weight.grad
    rows = torch.tensor([1, 4, 7])
    strided = grad[rows].t().contiguous().t()  # the same values, column-major
    assert not strided.is_contiguous()
    sparse_model.embed.weight.grad = torch.sparse_coo_tensor(
        rows[None], strided, grad.shape, is_coalesced=True, check_invariants=True
    )
    sparse_model.head.weight.grad = dense_model.head.weight.grad.clone()
    sparse_model.head.bias.grad = dense_model.head.bias.grad.clone()
    dense.step(inputs={dense_model.embed: [Call(dense_model.embed, (tokens,), {})]})
    sparse.step(inputs={})
    assert torch.equal(dense_model.embed.weight, sparse_model.embed.weight)


def test_compiled_with_no_graph_break_and_one_graph() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(16, 1))
    optimizer = LazyAdamW(model, lr=0.01)
    compiled = torch.compile(model, backend="eager")
    for _ in range(3):
        optimizer.zero_grad()
        compiled(torch.randint(0, 50, (4, 2))).sum().backward()
        optimizer.step()
    assert sum(counters["graph_break"].values()) == 0  # the row audit's own forward hook broke it twice
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_the_capture_is_the_only_hook_owner_and_dropping_the_optimizer_leaves_none() -> None:
    import gc
    import weakref

    model = nn.Sequential(nn.Embedding(40, 3), nn.Flatten(), nn.Linear(6, 1))
    optimizer = LazyAdamW(model, lr=0.1)
    model(torch.randint(0, 40, (5, 2))).sum().backward()
    optimizer.step()
    logs = {id(h.__self__) for m in model.modules() for h in m._forward_hooks.values()}
    assert len(logs) == 1  # every module hook is the one capture's
    assert model[0].weight._backward_hooks  # the audit's tensor hook, the capture's too
    gone = weakref.ref(optimizer)
    del optimizer
    gc.collect()
    assert gone() is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(not p._backward_hooks for p in model.parameters())


@pytest.mark.parametrize("amsgrad", [False, True])
def test_sparse_gradient_rows_are_bitwise_stock_fused_adamw_on_the_coalesced_rows(amsgrad: bool) -> None:
    """sparse=True: the rows and their summed gradient come from the coalesced gradient, and move
    exactly as fused AdamW moves them; no other row changes."""
    h = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.2, "amsgrad": amsgrad}
    torch.manual_seed(0)
    embed = nn.Embedding(500, 8, sparse=True)
    optimizer = LazyAdamW(embed, **h)
    generator = torch.Generator().manual_seed(1)
    for count in (5, 300, 40):  # with repeated ids: the coalescing sums their gradients
        tokens = torch.randint(0, 500, (count,), generator=generator)
        optimizer.zero_grad()
        embed(tokens).mul(torch.randn(count, 8, generator=generator)).sum().backward()
        dense = embed.weight.grad.coalesce().to_dense()
        rows = torch.unique(tokens)
        state = {k: v.clone() for k, v in optimizer.state[embed.weight].items()}
        reference = nn.Embedding(500, 8)
        reference.weight.data.copy_(embed.weight.detach())
        reference.weight.grad = dense
        expected = _adamw_on_rows(reference.weight, state, rows, **h)
        before = embed.weight.detach().clone()
        optimizer.step()
        assert torch.equal(embed.weight[rows], expected["weight"])
        for key in ("exp_avg", "exp_avg_sq", *(["max_exp_avg_sq"] if amsgrad else [])):
            assert torch.equal(optimizer.state[embed.weight][key][rows], expected[key]), key
        untouched = torch.ones(500, dtype=torch.bool)
        untouched[rows] = False
        assert torch.equal(embed.weight[untouched], before[untouched])


def test_a_sparse_table_keeps_nothing_from_its_forward() -> None:
    """Its gradient lists the rows: the forward hook computes no touched rows for it."""
    model = Bag(sparse=True)
    optimizer = LazyAdamW(model, lr=0.1)
    loss_of(model, batches(1)[0]).backward()
    assert model.embed.weight not in optimizer.capture.reduced(optimizer._rows)
    optimizer.step()


def test_a_negative_row_handed_to_step_changes_nothing() -> None:
    model = Bag()
    optimizer = LazyAdamW(model, lr=0.1)
    loss_of(model, batches(1)[0]).backward()
    before = [p.detach().clone() for p in model.parameters()]
    bad = {model.embed: [Call(model.embed, (torch.tensor([[3, -2]]),), {})]}
    with pytest.raises(ValueError, match=r"inputs of embed index row -2 of a table of 30 rows"):
        optimizer.step(inputs=bad)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert not optimizer.state


def test_every_argument_is_in_the_signature_and_a_foreign_one_is_refused_by_name() -> None:
    import inspect

    names = set(inspect.signature(LazyAdamW).parameters)
    assert {"lr", "betas", "eps", "weight_decay", "amsgrad", "params", "maximize", "foreach", "fused"} <= names
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(LazyAdamW).parameters.values())
    with pytest.raises(TypeError, match="LazyAdamW"):
        LazyAdamW(Bag(), dampening=0.1)  # type: ignore[call-arg]
    documented = LazyAdamW.__doc__ or ""
    for name in names - {"self"}:
        assert f"\n        {name}: " in documented, name


def test_a_table_with_a_zero_gradient_and_no_call_moves_no_row() -> None:
    # A table unused in a step whose gradients were zeroed in place (zero_grad(set_to_none=False)) has
    # a zero gradient and no call: the rule touches no row. It was warned about and updated densely
    # (every row with momentum moved); a later change had silenced the warning.
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.head = nn.Embedding(10, 4), nn.Embedding(10, 4), nn.Linear(4, 1)

        def forward(self, tokens: torch.Tensor, use_b: bool) -> torch.Tensor:
            return self.head(self.a(tokens) + (self.b(tokens) if use_b else 0)).sum()

    model, tokens = Two(), torch.tensor([[1, 2]])
    optimizer = LazyAdamW(model, lr=0.1)
    optimizer.zero_grad()
    model(tokens, True).backward()
    optimizer.step()
    weight, moments = model.b.weight.detach().clone(), optimizer.state[model.b.weight]["exp_avg"].clone()
    optimizer.zero_grad(set_to_none=False)
    model(tokens, False).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()
    assert torch.equal(model.b.weight, weight) and torch.equal(optimizer.state[model.b.weight]["exp_avg"], moments)
