"""torch.compile: inputs arrive whether the model is compiled before or after the optimizer."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from inputaware_optim import (
    DPSGD,
    FOOF,
    KFAC,
    NLMS,
    Capture,
    Eva,
    InputAwareSGD,
    LazyAdamW,
    Monitor,
    NonFiniteFinder,
    NonFiniteWarning,
)

from .conftest import mlp


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class CallReader(InputAwareSGD):
    """A drop-in that reads raw calls (as a custom rule does), so that its capture keeps them."""

    reads_calls = True


Seen = dict[nn.Module, list[torch.Tensor]]


def first_inputs(capture: Capture) -> Seen:
    return {m: [c.args[0] for c in entry] for m, entry in capture.inputs().items()}


def assert_same_inputs(
    compiled: dict[nn.Module, list[torch.Tensor]], eager: dict[nn.Module, list[torch.Tensor]]
) -> None:
    assert len(compiled) == len(eager) > 0
    for (m, xs), (n, ys) in zip(compiled.items(), eager.items(), strict=True):
        assert type(m) is type(n) and len(xs) == len(ys) > 0
        for x, y in zip(xs, ys, strict=True):
            torch.testing.assert_close(x, y)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_after_the_optimizer(backend: str) -> None:
    eager_model, model = MLP(), MLP()
    x = torch.randn(5, 4)
    eager = Capture(eager_model)
    eager_model(x).sum().backward()
    optimizer = CallReader(model, lr=0.1)
    compiled = torch.compile(model, backend=backend)
    compiled(x).sum().backward()
    assert_same_inputs(first_inputs(optimizer.capture), first_inputs(eager))


@pytest.mark.parametrize("how", ["wrapper", "in_place", "builtin"])
def test_compiled_and_run_before_the_optimizer(how: str) -> None:
    model: nn.Module = mlp() if how == "builtin" else MLP()
    if how == "in_place":
        model.compile(backend="aot_eager")
        compiled = model
    else:
        compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(3, 4)
    compiled(x).sum().backward()  # compiled code now exists, traced without our hooks
    optimizer = CallReader(compiled, lr=0.1)
    compiled(x).sum().backward()
    calls = optimizer.capture.calls()
    assert [type(c.module) for c in calls] == [nn.Linear, nn.Linear]
    assert torch.equal(calls[0].args[0], x)


def test_no_recompilation_when_the_number_of_calls_per_step_changes() -> None:
    model = MLP()
    optimizer = CallReader(model, lr=0.1)
    compiled = torch.compile(model, backend="aot_eager")
    compiled(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    frames = counters["frames"]["total"]
    for micro_batches in (1, 3, 2, 5):
        for _ in range(micro_batches):
            compiled(torch.randn(3, 4)).sum().backward()
        assert len(optimizer.capture.calls()) == 2 * micro_batches
        optimizer.step()
    assert counters["frames"]["total"] == frames


def test_zero_graph_breaks_with_capture_on() -> None:
    model = MLP()
    CallReader(model, lr=0.1)
    explanation = torch._dynamo.explain(model)(torch.randn(3, 4))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compiled_code_stops_recording_once_the_optimizer_is_gone() -> None:
    model = MLP()
    optimizer = CallReader(model, lr=0.1)
    compiled = torch.compile(model, backend="aot_eager")
    compiled(torch.randn(3, 4)).sum().backward()
    log = weakref.ref(optimizer.capture._log)
    del optimizer
    gc.collect()
    for _ in range(3):
        compiled(torch.randn(3, 4)).sum().backward()
    assert log() is None or log().head is None  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_output_gradients_arrive_from_compiled_code_without_graph_breaks(backend: str) -> None:
    x = torch.randn(5, 4)
    eager_model, model = MLP(), MLP()
    eager = Capture(eager_model, grad_outputs=True)
    eager_model(x).pow(2).sum().backward()
    capture = Capture(model, grad_outputs=True)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    capture.clear()
    compiled = torch.compile(model, backend=backend)
    for _ in range(2):  # the second time from the cached compiled code
        capture.clear()
        model.zero_grad()
        compiled(x).pow(2).sum().backward()
        got, want = capture.calls(), eager.calls()
        assert len(got) == len(want) == 2
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.grad_output, b.grad_output)
        for p, q in zip(model.parameters(), eager_model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)  # the gradients themselves are untouched


def test_transformer_block_has_zero_graph_breaks_and_captures_what_eager_does() -> None:
    torch.manual_seed(0)
    block = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True, dropout=0.0)
    x = torch.randn(2, 5, 32)
    eager = Capture(block)
    block(x).sum().backward()
    eager_seen = first_inputs(eager)
    eager.remove()
    optimizer = CallReader(block, lr=0.1, grad_outputs=True)
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    optimizer.zero_grad()
    torch.compile(block, backend="aot_eager")(x).sum().backward()
    assert_same_inputs(first_inputs(optimizer.capture), eager_seen)


RULE_FACTORIES = {
    "FOOF": lambda m: FOOF(m, lr=0.1, update_every=1),
    "KFAC": lambda m: KFAC(m, lr=0.1, update_every=1, damping=1e-2),
    "NLMS": lambda m: NLMS(m, lr=0.2),
    "DPSGD": lambda m: DPSGD(m, lr=0.5, max_grad_norm=0.5, noise_multiplier=0.0),
    "LazyAdamW": lambda m: LazyAdamW(m, lr=0.05),
}


class TokenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.a, self.b = nn.Embedding(20, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(self.embed(tokens)))).mean(1)


@pytest.mark.parametrize(
    ("rule", "backend"),
    [(rule, "aot_eager") for rule in RULE_FACTORIES] + [("KFAC", "inductor")],
)
def test_rules_under_a_compiled_model_match_eager(rule: str, backend: str) -> None:
    generator = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 20, (6, 4), generator=generator), torch.randn(6, 3, generator=generator))]
    data += [(torch.randint(0, 20, (6, 4), generator=generator), torch.randn(6, 3, generator=generator))]
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = TokenNet()
        optimizer = RULE_FACTORIES[rule](model)
        run = torch.compile(model, backend=backend) if compiled else model
        for tokens, target in data:
            optimizer.zero_grad()
            (run(tokens) - target).pow(2).sum(1).mean().backward()
            optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for eager_param, compiled_param in zip(*results, strict=True):
        torch.testing.assert_close(compiled_param, eager_param, rtol=1e-4, atol=1e-5)


class Positions(nn.Module):
    """Positions ``torch.arange(T)`` broadcast over the samples (batch = context, so the sizes agree)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens, self.positions, self.head = nn.Embedding(20, 8), nn.Embedding(4, 8), nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1]))).mean(1)


def test_dp_on_a_compiled_model_checks_each_forwards_batch_and_accumulates_as_eager() -> None:
    """Compiled code kept no count of forwards: DP skipped its batch checks there (positions broadcast over
    the samples were clipped as samples, silently) and took two micro-batches for one forward. The count
    runs eagerly at each forward's start where DP reads it: refused as in eager, accumulation exact."""
    model = Positions()
    optimizer = DPSGD(model, lr=0.5, max_grad_norm=0.5, noise_multiplier=0.0)
    torch.compile(model, backend="aot_eager")(torch.randint(0, 20, (4, 4))).sum().backward()
    with pytest.raises(RuntimeError, match=r"positions is called with indices of shape \(4,\)"):
        optimizer.step()
    generator = torch.Generator().manual_seed(0)
    tokens, target = torch.randint(0, 20, (6, 4), generator=generator), torch.randn(6, 3, generator=generator)
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = TokenNet()
        optimizer = DPSGD(model, lr=0.5, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=6)
        run = torch.compile(model, backend="aot_eager") if compiled else model
        for _ in range(2):
            optimizer.zero_grad()
            for part in (slice(0, 2), slice(2, 6)):  # two micro-batches, each loss its share of the step's
                ((run(tokens[part]) - target[part]).pow(2).sum(1).sum() / 6).backward()
            optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for eager_param, compiled_param in zip(*results, strict=True):
        torch.testing.assert_close(compiled_param, eager_param, rtol=1e-5, atol=1e-7)


def test_an_input_changed_in_place_after_a_compiled_call_is_detected() -> None:
    model = MLP()
    optimizer = CallReader(model, lr=0.1)
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(5, 4)
    compiled(x).sum().backward()
    assert len(optimizer.capture.calls()) == 2  # a first read, then the change
    x.add_(1.0)  # the caller reuses its input buffer
    with pytest.raises(RuntimeError, match=r"modified in place.*storage='clone'"):
        optimizer.capture.calls()


SCHEDULED = {
    "FOOF": lambda m, every: FOOF(m, lr=0.1, statistics_every=every),
    "KFAC": lambda m, every: KFAC(m, lr=0.1, damping=1e-2, statistics_every=every),
    "Eva": lambda m, every: Eva(m, lr=0.1, statistics_every=every),
}


def compiles_and_breaks(make: Any, steps: int = 6) -> tuple[int, int, list[torch.Tensor]]:
    """Graphs compiled and graph breaks over ``steps`` training steps of a compiled ``TokenNet``,
    with the parameters reached."""
    torch._dynamo.reset()
    counters.clear()
    model = TokenNet()
    optimizer = make(model)
    compiled = torch.compile(model, backend="aot_eager")
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        tokens, target = torch.randint(0, 20, (6, 4), generator=generator), torch.randn(6, 3, generator=generator)
        optimizer.zero_grad()
        (compiled(tokens) - target).pow(2).sum(1).mean().backward()
        optimizer.step()
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    return graphs, breaks, [p.detach().clone() for p in model.parameters()]


@pytest.mark.filterwarnings("ignore::inputaware_optim.CoverageWarning")
@pytest.mark.parametrize("rule", list(SCHEDULED))
def test_statistics_every_k_compiles_once_like_every_step(rule: str) -> None:
    """A rule pausing its statistics between statistics steps once made the hooks' reader set
    a guard: the model's forward compiled again for the steps without statistics."""
    every_step = compiles_and_breaks(lambda m: SCHEDULED[rule](m, 1))
    every_third = compiles_and_breaks(lambda m: SCHEDULED[rule](m, 3))
    assert every_step[:2] == every_third[:2] == (1, 0)
    eager = TokenNet()
    optimizer = SCHEDULED[rule](eager, 3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(6):
        tokens, target = torch.randint(0, 20, (6, 4), generator=generator), torch.randn(6, 3, generator=generator)
        optimizer.zero_grad()
        (eager(tokens) - target).pow(2).sum(1).mean().backward()
        optimizer.step()
    for compiled_param, eager_param in zip(every_third[2], eager.parameters(), strict=True):
        torch.testing.assert_close(compiled_param, eager_param, rtol=1e-4, atol=1e-5)


def test_lazy_adamw_compiles_one_graph_without_breaks() -> None:
    graphs, breaks, _ = compiles_and_breaks(lambda m: LazyAdamW(m, lr=0.05))
    assert (graphs, breaks) == (1, 0)


def test_monitor_and_finder_on_a_compiled_model_compile_once_and_report_as_eager() -> None:
    # The finder's callbacks were traced: keyed by each tensor's id, they compiled 15 graphs; beside
    # a Monitor the readers' statistics were traced as well (after graph breaks) and compiled more
    # graphs at every step (40 after 3 steps, 45 after 8). Callbacks and readers now run eagerly.
    tools: list[Any] = []

    def monitored(model: nn.Module, finder: bool) -> InputAwareSGD:
        optimizer = InputAwareSGD(model, lr=0.1)
        tools.append(Monitor(optimizer))
        if finder:
            tools.append(NonFiniteFinder(optimizer))
        return optimizer

    assert compiles_and_breaks(lambda m: monitored(m, False), 3)[:2] == (1, 0)
    shorter, longer = (compiles_and_breaks(lambda m: monitored(m, True), steps) for steps in (3, 8))
    assert shorter[:2] == longer[:2]
    compiled_record, eager_record = tools[-2].last, None
    eager = TokenNet()
    optimizer = monitored(eager, True)
    generator = torch.Generator().manual_seed(0)
    for _ in range(8):
        tokens, target = torch.randint(0, 20, (6, 4), generator=generator), torch.randn(6, 3, generator=generator)
        optimizer.zero_grad()
        (eager(tokens) - target).pow(2).sum(1).mean().backward()
        optimizer.step()
    eager_record = tools[-2].last
    assert compiled_record["modules"].keys() == eager_record["modules"].keys() == {"a", "b"}  # (embed: tokens)
    for name, statistics in eager_record["modules"].items():
        assert compiled_record["modules"][name] == pytest.approx(statistics, rel=1e-4, abs=1e-6)
    torch._dynamo.reset()
    model = TokenNet()
    finder = NonFiniteFinder(torch.optim.SGD(model.parameters(), lr=0.1), model)
    with torch.no_grad():
        model.a.weight[0, 0] = float("inf")
    with pytest.warns(NonFiniteWarning, match=r"a \(call 0\) in the forward"):
        finder.optimizer.zero_grad()
        torch.compile(model, backend="aot_eager")(torch.randint(0, 20, (6, 4))).sum().backward()
        finder.optimizer.step()
    assert finder.found is not None and (finder.found.module, finder.found.phase) == ("a", "forward")


@pytest.mark.parametrize("plain", [False, True])
def test_fullgraph_with_a_finder_is_refused_naming_the_finder_and_what_to_do(plain: bool) -> None:
    # torch.compile(fullgraph=True) failed with torch's generic "Skip calling torch.compiler.disable()d
    # function ... (reason: None)", naming neither the finder nor what to do.
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if plain else InputAwareSGD(model, lr=0.1)
    monitor = Monitor(optimizer, model if plain else None)  # (compiles with the model: not refused)
    finder = NonFiniteFinder(optimizer, model if plain else None)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"NonFiniteFinder watches every call of the model eagerly") as raised:
        compiled(torch.randn(3, 4))
    assert "compile without fullgraph=True, or remove() the NonFiniteFinder" in str(raised.value)
    finder.remove()
    torch._dynamo.reset()
    compiled(torch.randn(3, 4)).sum().backward()  # without the finder: one graph, the Monitor's statistics in it
    optimizer.step()
    assert monitor.last is not None and monitor.last["modules"].keys() == {"a", "b"}
    monitor.remove()


def test_load_balancing_on_a_compiled_moe_moves_the_biases_as_eager() -> None:
    # Compiled code kept a call's arguments, not its output, so LoadBalancing (which reads the
    # experts each token was routed to from the router's output) failed on a compiled model.
    from .test_moe import Net, attach, data

    biases = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = Net()
        optimizer = InputAwareSGD(model, lr=0.05)
        attach(model, optimizer, 0.01)
        run = torch.compile(model, backend="aot_eager") if compiled else model
        for step in range(3):
            optimizer.zero_grad()
            run(data(step)).pow(2).mean().backward()
            optimizer.step()
        biases.append(model.moe.router.expert_bias.detach().clone())
    assert biases[0].any() and torch.equal(biases[0], biases[1])
