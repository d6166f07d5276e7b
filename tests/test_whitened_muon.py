"""WhitenedMuon against its dense float64 formula, torch.optim.Muon, and under the training stack.

The formula's reference (``Reference("whitened_muon")``, tests/test_candidates.py) writes the rule out with
``torch.linalg``: ``eigh`` for ``A_λ^(-1/2)``, the SVD's ``U Vᵀ`` for the exact polar factor, Muon's Newton–Schulz
(``benchmarks.baselines.newton_schulz``, itself tested against ``torch.optim.Muon``) for the default one.
"""

from __future__ import annotations

import copy
import io
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from benchmarks.baselines import Float32Muon
from inputaware_optim import InputAwareOptimizer, WhitenedMuon, WhitenedMuonPreconditioner
from inputaware_optim.whitened_muon import newton_schulz

from .test_candidates import Reference, data, exact_polar, loss_of, muon_polar


def linear_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()]


def train(model: nn.Module, optimizer: Any, batches: list[tuple[Tensor, Tensor]], micro_batches: int = 1) -> None:
    for x, y in batches:
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
            (loss_of(model, xs, ys) / micro_batches).backward()
        optimizer.step()


def batches(seed: int, steps: int, rows: int, inputs: int, outputs: int) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [data(generator, rows, inputs, outputs) for _ in range(steps)]


def mlp(bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7, bias=bias), nn.Tanh(), nn.Linear(7, 3, bias=bias)).double()


# -- the formula -------------------------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(
    inputs=st.integers(1, 6),
    outputs=st.integers(1, 6),
    bias=st.booleans(),
    damping=st.sampled_from([1e-3, 1e-2, 0.1, 1.0]),
    exact=st.booleans(),
    nesterov=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_steps_are_the_formula(
    inputs: int, outputs: int, bias: bool, damping: float, exact: bool, nesterov: bool, seed: int
) -> None:
    """Four steps on a random ``Linear`` (a refresh at steps 0 and 2) with weight decay: after each, the weights are
    the dense float64 formula's (the exact polar factor with ``polar="svd"``, Muon's Newton–Schulz otherwise)."""
    torch.manual_seed(seed)
    layer = nn.Linear(inputs, outputs, bias=bias).double()
    twin = copy.deepcopy(layer)
    optimizer = WhitenedMuon(
        layer,
        lr=0.05,
        weight_decay=0.1,
        damping=damping,
        update_every=2,
        nesterov=nesterov,
        polar="svd" if exact else "newton-schulz",
    )
    reference = Reference(
        "whitened_muon",
        exact_polar if exact else muon_polar,
        damping=damping,
        update_every=2,
        lr=0.05,
        weight_decay=0.1,
        nesterov=nesterov,
    )
    for x, y in batches(seed, 4, 3 * (inputs + outputs) + 4, inputs, outputs):
        train(layer, optimizer, [(x, y)])
        reference.step(twin, x, y)
        for ours, theirs in zip(layer.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-7, atol=1e-9)


def test_statistics_every_k_and_refreshes_are_the_formula() -> None:
    """Seven steps, statistics every 2 and refreshes at least 3 steps apart, on two layers: the formula's schedule."""
    options = {"damping": 0.05, "stat_decay": 0.8, "update_every": 3, "statistics_every": 2}
    model, twin = mlp(), mlp()
    optimizer = WhitenedMuon(model, lr=0.05, weight_decay=0.01, polar="svd", **options)
    reference = Reference("whitened_muon", lr=0.05, weight_decay=0.01, **options)
    for x, y in batches(3, 7, 24, 5, 3):
        train(model, optimizer, [(x, y)])
        reference.step(twin, x, y)
        for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-7, atol=1e-9)
    state = optimizer.rules[0].state[model[0].weight]
    assert state["statistics_steps"] == 4 and state["inverse_step"] == 4


def test_newton_schulz_is_muons() -> None:
    """The library's Newton–Schulz is torch.optim.Muon's iteration: on float64 matrices of both orientations it
    equals the benchmark's copy of torch's (itself tested against torch.optim.Muon), to rounding."""
    generator = torch.Generator().manual_seed(0)
    for shape in ((5, 9), (9, 5), (6, 6)):
        matrix = torch.randn(shape, generator=generator, dtype=torch.float64)
        torch.testing.assert_close(newton_schulz(matrix), muon_polar(matrix), rtol=1e-12, atol=1e-12)


def test_with_the_input_factor_swamped_by_damping_it_is_torch_muon() -> None:
    """``A_λ^(-1/2) → λ^(-1/2) I`` as ``λ`` grows: at learning rate ``lr · λ^(1/2)`` WhitenedMuon is then
    ``torch.optim.Muon`` (``adjust_lr_fn="match_rms_adamw"``), whose Newton–Schulz runs in bfloat16: equal to that
    precision, over four steps with momentum and weight decay."""
    torch.manual_seed(0)
    model = nn.Linear(7, 5, bias=False)
    twin = copy.deepcopy(model)
    damping, lr, weight_decay = 1e10, 0.02, 0.1
    scaled = lr * math.sqrt(damping)
    ours = WhitenedMuon(model, lr=scaled, weight_decay=lr * weight_decay / scaled, damping=damping)
    muon = torch.optim.Muon(twin.parameters(), lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = (t.float() for t in data(generator, 32, 7, 5))
        for m, o in ((model, ours), (twin, muon)):
            o.zero_grad()
            loss_of(m, x, y).backward()
            o.step()
    change = (model.weight - twin.weight).detach().abs().max() / lr
    assert float(change) < 0.05, change  # bfloat16's Newton–Schulz: a few parts in a hundred of a step
    assert not torch.equal(model.weight, twin.weight)


def test_with_the_input_factor_swamped_by_damping_it_is_muon_in_float64() -> None:
    """As above in float64, against the benchmark's ``Float32Muon`` (torch.optim.Muon with its Newton–Schulz in the
    gradient's dtype, tested against it in tests/test_baselines.py): equal to rounding."""
    torch.manual_seed(0)
    model = nn.Linear(7, 5, bias=False).double()
    twin = copy.deepcopy(model)
    damping, lr, weight_decay = 1e12, 0.02, 0.1
    scaled = lr * math.sqrt(damping)
    ours = WhitenedMuon(model, lr=scaled, weight_decay=lr * weight_decay / scaled, damping=damping)
    muon = Float32Muon(twin.parameters(), lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = data(generator, 32, 7, 5)
        for m, o in ((model, ours), (twin, muon)):
            o.zero_grad()
            loss_of(m, x, y).backward()
            o.step()
    torch.testing.assert_close(model.weight, twin.weight, rtol=1e-8, atol=1e-10)


def test_the_composition_is_the_optimizer() -> None:
    """``WhitenedMuonPreconditioner`` in front of ``torch.optim.SGD`` is ``WhitenedMuon``, bitwise."""
    model, twin = mlp(), mlp()
    ours = WhitenedMuon(model, lr=0.05, update_every=2)
    composed = InputAwareOptimizer(
        twin, rules=[WhitenedMuonPreconditioner(update_every=2)], base=torch.optim.SGD, lr=0.05, weight_decay=0.1
    )
    for x, y in batches(0, 4, 16, 5, 3):
        train(model, ours, [(x, y)])
        train(twin, composed, [(x, y)])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))


# -- the training stack ------------------------------------------------------------------------------------------


def test_accumulation_equals_one_batch() -> None:
    """Four micro-batches of a step (their losses over their number) give the step of the whole batch: the statistics
    are over the concatenated rows."""
    model, twin = mlp(), mlp()
    data_ = batches(1, 3, 24, 5, 3)
    train(model, WhitenedMuon(model, lr=0.05, update_every=1), data_, micro_batches=4)
    train(twin, WhitenedMuon(twin, lr=0.05, update_every=1), data_)
    for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.body, self.reentrant = mlp(), reentrant

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(self.body, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_is_exact(reentrant: bool) -> None:
    """Under ``torch.utils.checkpoint`` (each forward run twice) the statistics count each call once: the same steps
    as without it, bitwise."""
    model, plain = Checkpointed(reentrant), mlp()
    data_ = [(x.requires_grad_(reentrant), y) for x, y in batches(2, 3, 16, 5, 3)]  # (reentrant needs an input grad)
    train(model, WhitenedMuon(model, lr=0.05, update_every=1, params=linear_params(model)), data_)
    train(plain, WhitenedMuon(plain, lr=0.05, update_every=1), data_)
    assert all(torch.equal(p, q) for p, q in zip(model.body.parameters(), plain.parameters(), strict=True))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_under_a_compiled_model_it_matches_eager(backend: str) -> None:
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = mlp().float()
        optimizer = WhitenedMuon(model, lr=0.05, update_every=1)
        run = torch.compile(model, backend=backend) if compiled else model
        for x, y in batches(4, 3, 16, 5, 3):
            optimizer.zero_grad()
            loss_of(run, x.float(), y.float()).backward()
            optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for eager, compiled_ in zip(*results, strict=True):
        torch.testing.assert_close(compiled_, eager, rtol=1e-4, atol=1e-5)


def test_a_closure_steps_as_the_plain_loop() -> None:
    """``opt.step(closure)`` (how trainers step) is the plain loop's step, bitwise, and returns the closure's loss."""
    model, twin = mlp(), mlp()
    ours, plain = WhitenedMuon(model, lr=0.05, update_every=2), WhitenedMuon(twin, lr=0.05, update_every=2)
    for x, y in batches(8, 4, 16, 5, 3):

        def closure(x: Tensor = x, y: Tensor = y) -> Tensor:
            ours.zero_grad()
            loss = loss_of(model, x, y)
            loss.backward()
            return loss

        expected = loss_of(twin, x, y).detach()  # (the twin's weights are the model's: the loss the closure sees)
        returned = ours.step(closure)
        train(twin, plain, [(x, y)])
        assert torch.equal(returned.detach(), expected)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))


def test_state_dict_round_trip_resumes_bitwise() -> None:
    """Saved after 3 steps and loaded into a fresh optimizer on a copy of the model: the next 4 steps (a refresh
    among them) are bitwise those of the run that never stopped."""
    model = mlp()
    optimizer = WhitenedMuon(model, lr=0.05, update_every=3)
    data_ = batches(5, 7, 16, 5, 3)
    train(model, optimizer, data_[:3])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    train(model, optimizer, data_[3:])
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = mlp()
    resumed.load_state_dict(saved["model"])
    again = WhitenedMuon(resumed, lr=0.05, update_every=3)
    again.load_state_dict(saved["optimizer"])
    train(resumed, again, data_[3:])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters(), strict=True))


def test_bfloat16_model_keeps_a_float32_momentum_and_trains() -> None:
    model = mlp().to(torch.bfloat16)
    optimizer = WhitenedMuon(model, lr=0.02)
    x, y = batches(6, 1, 32, 5, 3)[0]
    first = float(loss_of(model, x.bfloat16(), y.bfloat16()).detach())
    for _ in range(5):
        train(model, optimizer, [(x.bfloat16(), y.bfloat16())])
    assert optimizer.rules[0].state[model[0].weight]["momentum_buffer"].dtype == torch.float32
    assert model[0].weight.dtype == torch.bfloat16
    assert float(loss_of(model, x.bfloat16(), y.bfloat16()).detach()) < first


# -- refusals ----------------------------------------------------------------------------------------------------


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.norm(self.embed(tokens)))


def test_parameters_it_does_not_whiten_are_refused_by_name_leaving_no_hook() -> None:
    model = Tokens()
    with pytest.raises(ValueError, match=r"it was given embed\.weight, norm\.weight, norm\.bias, which it does not"):
        WhitenedMuon(model, lr=0.01)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    optimizer = WhitenedMuon(model, lr=0.01, params=model.head.parameters())  # the recipe: the rest to AdamW
    with pytest.raises(ValueError, match=r"it was given embed\.weight"):
        optimizer.add_param_group({"params": [model.embed.weight]})


def test_bad_hyperparameters_and_bases_are_refused_by_name() -> None:
    model = mlp()
    with pytest.raises(ValueError, match=r"Invalid momentum: 1\.0"):
        WhitenedMuon(model, lr=0.01, momentum=1.0)
    with pytest.raises(ValueError, match="Invalid polar: 'qr'"):
        WhitenedMuon(model, lr=0.01, polar="qr")
    with pytest.raises(TypeError, match="takes no base="):
        WhitenedMuon(model, lr=0.01, base=torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"a base momentum of 0\.9 would apply momentum a second time"):
        InputAwareOptimizer(model, rules=[WhitenedMuonPreconditioner()], base=torch.optim.SGD, lr=0.1, momentum=0.9)
    optimizer = WhitenedMuon(model, lr=0.01)
    optimizer.param_groups[0]["momentum"] = 0.9  # a scheduler touching SGD's key: refused at the step
    loss_of(model, *batches(0, 1, 8, 5, 3)[0]).backward()
    with pytest.raises(ValueError, match="set WhitenedMuon's own with momentum="):
        optimizer.step()


def test_an_ill_conditioned_factor_is_refused_by_name_changing_nothing() -> None:
    """Inputs of rank 2 with damping set to 0 since the last step: the refreshed factor's condition number is over
    ``condition_limit``, so the step is refused naming the layer and the damping, and nothing moves (the momentum
    buffer included)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4))
    optimizer = WhitenedMuon(model, lr=0.01, damping=0.01, stat_decay=0.0, update_every=1)
    x, y = torch.randn(32, 5), torch.randn(32, 4)
    train(model, optimizer, [(x, y)])
    optimizer.param_groups[0]["damping"] = 0.0
    optimizer.zero_grad()
    loss_of(model, torch.randn(2, 5).repeat(16, 1), y).backward()
    state = optimizer.rules[0].state[model[0].weight]
    before = [t.clone() for t in (*model.parameters(), *(p.grad for p in model.parameters()))]
    kept = {k: v.clone() for k, v in state.items() if isinstance(v, Tensor)}
    with pytest.raises(RuntimeError, match=r"0 \(input\).*damping=0"):
        optimizer.step()
    after = [*model.parameters(), *(p.grad for p in model.parameters())]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(torch.equal(kept[k], state[k]) for k in kept)


def test_a_new_damping_applies_at_the_next_step_from_the_kept_decomposition() -> None:
    """Between refreshes a change of ``damping`` forms ``A_λ^(-1/2)`` again from the kept eigendecomposition: the
    kept root is the new damping's, with no new ``eigh``."""
    model = mlp()
    optimizer = WhitenedMuon(model, lr=0.05, update_every=100)
    data_ = batches(7, 2, 16, 5, 3)
    train(model, optimizer, data_[:1])
    state = optimizer.rules[0].state[model[0].weight]
    vectors = state["input_eigenvectors"].clone()
    optimizer.param_groups[0]["damping"] = 0.5
    train(model, optimizer, data_[1:])
    assert torch.equal(state["input_eigenvectors"], vectors)  # (no refresh)
    expected = vectors @ torch.diag((state["input_eigenvalues"] + 0.5).rsqrt()) @ vectors.T
    torch.testing.assert_close(state["input_inverse_root"], expected, rtol=1e-12, atol=1e-12)
    assert state["input_inverse_damping"] == 0.5


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_muons_recipe_on_a_real_transformer_whitens_every_hidden_matrix(name: str) -> None:
    """Tiny random-weight Hugging Face models (GPT-2's ``Conv1D``, Llama's ``Linear``), Muon's recipe: WhitenedMuon
    on every hidden matrix (each whitened, none left to SGD), AdamW on the embeddings, norms and the head; the
    language-model loss falls. Given every parameter, it refuses the embeddings by name."""
    pytest.importorskip("transformers")
    from .test_real_models import build, lm_loss, matrix_layers, tokens

    model = build(name)
    head = model.get_output_embeddings()
    hidden = [m.weight for m in matrix_layers(model).values() if m is not head]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    whitened = WhitenedMuon(model, lr=0.01, params=hidden)
    adamw = torch.optim.AdamW(rest, lr=0.01)
    coverage = {row.name: row for row in whitened.coverage()}
    assert all(row.treatment.startswith("WhitenedMuon") for row in coverage.values()), coverage
    assert len(coverage) == len(hidden)
    ids = tokens()
    losses = []
    for _ in range(4):
        whitened.zero_grad()
        adamw.zero_grad()
        loss = lm_loss(model, ids)
        loss.backward()
        whitened.step()
        adamw.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0], losses
    assert all("input_inverse_root" in whitened.rules[0].state[w] for w in hidden)
    with pytest.raises(ValueError, match="embed"):
        WhitenedMuon(build(name), lr=0.01)
