"""Mixed precision: autocast captures, GradScaler unscaling and skipped steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from inputaware_optim import InputAwareAdamW, InputAwareSGD, Monitor, NonFiniteFinder

from .conftest import mlp


class GradRecorder(InputAwareSGD):
    """Records the gradients and the number of calls it was handed."""

    @torch.no_grad()
    def step(self, closure: Any = None, inputs: Any = None) -> Any:
        self.grads = [p.grad.clone() for p in self.model.parameters()]
        self.calls = len(inputs.calls)
        self.inputs_seen = {m: [c.args[0].clone() for c in e] for m, e in inputs.items()}
        return super().step(inputs=inputs)


def scaled_steps(
    model: nn.Module, optimizer: Any, batches: list[torch.Tensor], poison: set[int]
) -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for i, x in enumerate(batches):
        model.zero_grad()  # not optimizer.zero_grad(): captures must be dropped by the skip itself
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        if i in poison:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return scaler


@pytest.mark.parametrize("implementation", [{"foreach": False}, {"foreach": True}, {"fused": True}])
@pytest.mark.parametrize("pair", [(InputAwareSGD, torch.optim.SGD), (InputAwareAdamW, torch.optim.AdamW)])
def test_grad_scaler_steps_are_bitwise_stock(pair: tuple[type, type], implementation: dict[str, bool]) -> None:
    ours_cls, stock_cls = pair
    batches = [torch.randn(4, 4, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    ours_model, stock_model = mlp(), mlp()
    extra = {"momentum": 0.9} if stock_cls is torch.optim.SGD else {}
    ours = ours_cls(ours_model, lr=0.01, **extra, **implementation)
    stock = stock_cls(stock_model.parameters(), lr=0.01, **extra, **implementation)
    ours_scaler = scaled_steps(ours_model, ours, batches, poison={1, 4})
    stock_scaler = scaled_steps(stock_model, stock, batches, poison={1, 4})
    assert ours_scaler.get_scale() == stock_scaler.get_scale()
    for p, q in zip(ours_model.parameters(), stock_model.parameters(), strict=True):
        assert torch.equal(p, q)
        assert ours.state[p].keys() == stock.state[q].keys()
        for key, value in stock.state[q].items():
            assert torch.equal(ours.state[p][key], value), key


def test_a_rule_sees_unscaled_gradients_and_skipped_steps_drop_their_captures() -> None:
    model, reference = mlp(), mlp()
    rule = GradRecorder(model, lr=0.01)
    x, poisoned = torch.randn(4, 4), torch.randn(9, 4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)

    # A poisoned step: the scaler skips it, the rule never runs, and its captures go.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(poisoned).float().sum() * float("inf")
    scaler.scale(loss).backward()
    scaler.step(rule)
    scaler.update()
    assert not hasattr(rule, "calls") and rule.capture.calls() == []

    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(rule)
    assert rule.calls == 2  # only this step's two Linear calls
    assert rule.inputs_seen[model[0]][0].shape == (4, 4)
    assert rule.inputs_seen[model[2]][0].dtype == torch.bfloat16  # what the module received under autocast

    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference(x).float().pow(2).mean().backward()
    for got, want in zip(rule.grads, (p.grad for p in reference.parameters()), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)  # unscaled before the rule ran


def test_rules_keep_float32_statistics_under_bfloat16_autocast() -> None:
    from inputaware_optim import FOOF, KFAC

    for cls in (FOOF, KFAC):
        model = mlp()
        optimizer = cls(model, lr=0.01)
        seen: list[torch.Tensor] = []
        handle = model[2].register_forward_pre_hook(lambda m, args, seen=seen: seen.append(args[0].detach().clone()))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(6, 4)).float().pow(2).mean()
        loss.backward()
        handle.remove()
        assert seen[0].dtype == torch.bfloat16  # what the module received under autocast
        (sums, count) = optimizer.capture.reduced(optimizer.rules[0]._statistics)[model[2].weight]["input"]
        rows = torch.cat([seen[0].float(), torch.ones(6, 1)], dim=1)
        assert sums.dtype == torch.float32 and count == 6
        torch.testing.assert_close(sums, rows.T @ rows)  # reduced in float32, not in bfloat16
        optimizer.step()
        for key, value in optimizer.state[model[2].weight].items():
            if isinstance(value, torch.Tensor) and key != "momentum_buffer":
                assert value.dtype == torch.float32, (cls.__name__, key)
        assert all(torch.isfinite(p).all() for p in model.parameters())


def _scaled_training(rule: str, scaler: torch.amp.GradScaler | None, poisoned_step: int = 1) -> torch.Tensor:
    """Three steps (one of them poisoned with inf, so a GradScaler skips it); the final parameters."""
    from inputaware_optim import DPSGD, FOOF, KFAC, NLMS, LazyAdamW, WhitenedMuon

    def linears(m: nn.Module) -> list[nn.Parameter]:  # (WhitenedMuon takes the layers it whitens alone)
        return [p for layer in m.modules() if isinstance(layer, nn.Linear) for p in layer.parameters()]

    rules = {
        "FOOF": lambda m: FOOF(m, lr=0.1, update_every=1, grad_scaler=scaler),
        "KFAC": lambda m: KFAC(m, lr=0.1, update_every=1, grad_scaler=scaler),
        "NLMS": lambda m: NLMS(m, lr=0.1, grad_scaler=scaler),
        "LazyAdamW": lambda m: LazyAdamW(m, lr=0.1, grad_scaler=scaler),
        "DPSGD": lambda m: DPSGD(m, lr=0.5, max_grad_norm=0.2, noise_multiplier=0.0, grad_scaler=scaler),
        "WhitenedMuon": lambda m: WhitenedMuon(m, lr=0.02, update_every=1, grad_scaler=scaler, params=linears(m)),
    }
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))
    optimizer = rules[rule](model)
    for step in range(4):
        generator = torch.Generator().manual_seed(step)
        tokens, target = torch.randint(0, 10, (5, 2), generator=generator), torch.randn(5, 3, generator=generator)
        optimizer.zero_grad()
        loss = (model(tokens) - target).pow(2).sum(1).mean()
        if step == poisoned_step:
            loss = loss * float("inf")
        if scaler is None:
            if step != poisoned_step:  # what a skipped step amounts to
                loss.backward()
                optimizer.step()
            continue
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("rule", ["FOOF", "KFAC", "NLMS", "LazyAdamW", "DPSGD", "WhitenedMuon"])
def test_every_rule_under_grad_scaler_equals_the_unscaled_step(rule: str) -> None:
    expected = _scaled_training(rule, None)
    for scale in (16.0, 1024.0):
        got = _scaled_training(rule, torch.amp.GradScaler("cpu", init_scale=scale))
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7, msg=f"{rule} at scale {scale}")


def test_output_gradient_rules_refuse_a_scaler_they_were_not_given_and_lose_nothing() -> None:
    from inputaware_optim import KFAC

    model = mlp()
    optimizer = KFAC(model, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaler.scale(model(torch.randn(4, 4)).pow(2).mean()).backward()
    scaled = [p.grad.clone() for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="grad_scaler=scaler"):
        scaler.step(optimizer)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), scaled, strict=True))
    optimizer.capture.grad_scaler = scaler  # told now: the same scaler steps it
    scaler.step(optimizer)
    scaler.update()
    assert not torch.equal(model[0].weight, before[0])


def test_a_rule_error_inside_scaler_step_leaves_the_gradients_and_the_scaler_usable() -> None:
    from inputaware_optim import FOOF

    torch.manual_seed(0)
    layer = nn.Linear(4, 2, bias=False)
    optimizer = FOOF(layer, lr=0.1, damping=0.0, update_every=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    x = torch.randn(3, 4)
    x[:, 3] = 0  # singular without damping
    scaler.scale(layer(x).pow(2).sum()).backward()
    scaled = layer.weight.grad.clone()
    with pytest.raises(RuntimeError, match="increase damping"):
        scaler.step(optimizer)
    assert torch.equal(layer.weight.grad, scaled)  # scaled back, as GradScaler left it
    assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")
    optimizer.param_groups[0]["damping"] = 0.1
    scaler.step(optimizer)  # used to raise "unsupported operand type(s) for *: 'Tensor' and 'NoneType'"
    scaler.update()
    torch.testing.assert_close(optimizer.rules[0].state[layer.weight]["input_second_moment"], x.T @ x / 3)


def _float16_scaled_backward(optimizer: Any, model: nn.Module, scale: float, factor: float) -> None:
    """One float16-autocast step under a GradScaler at ``scale``, the loss multiplied by ``factor``
    (small: the unscaled loss's output gradients are below float16's normal range)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    optimizer.capture.grad_scaler = scaler
    generator = torch.Generator().manual_seed(0)
    x, target = torch.randn(6, 5, 8, generator=generator), torch.randn(6, 5, 3, generator=generator)
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = (model(x).float() - target).pow(2).mean() * factor
    scaler.scale(loss).backward()
    scaler.step(optimizer)


def test_output_gradients_are_unscaled_where_float16_cannot_underflow_them() -> None:
    # Unscaling a float16 output gradient in float16 flushes what the loss scale kept out of the
    # subnormals: readers get it unscaled in float32, exactly the scaled gradient over the scale.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    scaled: list[torch.Tensor] = []
    model[2].register_full_backward_hook(lambda m, gi, go: scaled.append(go[0]))

    class Reader(InputAwareSGD):
        @torch.no_grad()
        def step(self, closure: Any = None, inputs: Any = None) -> Any:
            self.seen = inputs[model[2]].grad_outputs()
            return super().step(inputs=inputs)

    reader = Reader(model, lr=0.0, grad_outputs=True)
    _float16_scaled_backward(reader, model, scale=2.0**12, factor=1e-5)
    (seen,) = reader.seen
    assert scaled[0].dtype == torch.float16 and seen.dtype == torch.float32
    assert (scaled[0].float() / 2.0**12).abs().max() < torch.finfo(torch.float16).smallest_normal
    assert torch.equal(seen, scaled[0].float() / 2.0**12)


def test_dp_steps_under_float16_autocast_the_same_at_any_loss_scale() -> None:
    # The per-sample sums are checked against backward's gradient: they used to be formed from
    # output gradients unscaled in float16 (flushed towards zero), and the check refused the step.
    from inputaware_optim import DPSGD

    results = []
    for scale in (2.0**12, 2.0**16):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        optimizer = DPSGD(model, lr=1.0, max_grad_norm=1e-7, noise_multiplier=0.0)
        _float16_scaled_backward(optimizer, model, scale=scale, factor=1e-5)
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(results[1], results[0], rtol=1e-3, atol=1e-9)


def test_dp_names_a_loss_scale_too_small_for_float16_and_changes_nothing() -> None:
    # At a scale this small, backward's own float16 weight gradients are subnormal: rounded by up
    # to half their smallest step, they no longer equal the per-sample sums, which DP refuses. The
    # refusal names the scale, not a tied weight or a clip.
    from inputaware_optim import DPSGD

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = DPSGD(model, lr=1.0, max_grad_norm=1e-7, noise_multiplier=0.0)
    with pytest.raises(RuntimeError, match=r"loss scale too small.*init_scale, or bfloat16.*No parameter was changed"):
        _float16_scaled_backward(optimizer, model, scale=2.0**4, factor=1e-5)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("plain", [False, True], ids=["input-aware", "plain"])
def test_monitor_and_finder_see_a_fused_step_under_grad_scaler_as_any_other(plain: bool) -> None:
    # GradScaler hands a fused AdamW its scale and overflow flag and calls step() even on a step it
    # skips (the kernel skips it); the tools read it as a step: the Monitor logged the skipped step and
    # gradient norms times the loss scale (1024x), and the finder warned of a non-finite gradient at
    # each overflow, the loss scale calibrating (with action="raise", training stopped).
    logged = {}
    for implementation in ({"foreach": True}, {"fused": True}):
        model = mlp()
        optimizer = (
            torch.optim.AdamW(model.parameters(), lr=0.01, **implementation)
            if plain
            else InputAwareAdamW(model, lr=0.01, **implementation)
        )
        records: list[dict[str, Any]] = []
        Monitor(optimizer, model if plain else None, callback=records.append)
        NonFiniteFinder(optimizer, model if plain else None, action="raise")
        batches = [torch.randn(6, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
        scaled_steps(model, optimizer, batches, poison={1})
        logged[next(iter(implementation))] = records
    assert [r["step"] for r in logged["fused"]] == [r["step"] for r in logged["foreach"]] == [0, 1, 2]
    for fused, foreach in zip(logged["fused"], logged["foreach"], strict=True):
        for name, statistics in foreach["parameters"].items():
            assert fused["parameters"][name]["grad_norm"] == pytest.approx(statistics["grad_norm"], rel=1e-6)
