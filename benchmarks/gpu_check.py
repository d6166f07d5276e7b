"""One short run over every CUDA path: ``python -m benchmarks.gpu_check``.

On one device it checks:

* ``noise``: DP's noise is drawn by a generator on the parameters' device (not on the CPU, then copied).
* ``kernels``: ``InputAwareSGD`` / ``InputAwareAdamW`` with the for-loop, foreach and fused
  kernels are bitwise ``torch.optim.SGD`` / ``AdamW`` with the same flags (parameters and
  state over several steps), plain and under float16 autocast with ``GradScaler`` (one
  overflowing step included, which both must skip).
* ``storage``: ``storage="cpu"`` keeps each captured input in pinned CPU memory, copied
  asynchronously; a rule reading them at ``step()`` while the device is still busy (and after
  the device tensor was overwritten) sees the inputs as they were in the forward.
* ``amp``: float16 autocast with ``GradScaler`` for every rule: an overflowing step is skipped
  (parameters and the rule's state untouched), the others leave finite parameters.
* ``compile``: every rule on a ``torch.compile``\\ d model (inductor) follows the eager run
  closely (a rule whose captures did not arrive would take another step, or refuse).
* ``gpt``: the realistic workload's configurations (``benchmarks/sections/gpt.py``: the drop-in,
  the Monitor, the finder, Eva, FOOF, K-FAC, DPAdamW, beside SGD and Muon) on the byte-level GPT
  at a GPU's batch (6 blocks, width 384, 32 × 256 tokens), each timed against AdamW; a row fails
  if it raises or its loss is not finite.

It prints one table: each check, its result, and the time of one training step (forward,
backward, step) against the same step with the stock optimizer (median over interleaved
rounds). Without CUDA it prints ``skipped: no CUDA`` and exits 0; ``--device cpu`` runs the
same checks on the CPU as a dry run (no pinned memory or CUDA streams there). Exit status 1
if any check failed.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from inputaware_optim import (
    DPSGD,
    FOOF,
    KFAC,
    NLMS,
    CoverageWarning,
    DPAdamW,
    InputAwareAdamW,
    InputAwareSGD,
    LazyAdamW,
    WhitenedMuon,
)

from .core import Config
from .timing import interleave

CHECKS = ("noise", "kernels", "storage", "amp", "compile", "gpt")
IMPLEMENTATIONS: dict[str, dict[str, Any]] = {
    "for-loop": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}
STOCK: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "SGD": lambda params, **kw: torch.optim.SGD(params, lr=0.01, momentum=0.9, **kw),
    "AdamW": lambda params, **kw: torch.optim.AdamW(params, lr=1e-3, **kw),
}
# Each rule, and the stock optimizer its time is compared with.
RULES: dict[str, tuple[Callable[..., torch.optim.Optimizer], str]] = {
    "InputAwareSGD": (lambda m, **kw: InputAwareSGD(m, lr=0.01, momentum=0.9, **kw), "SGD"),
    "InputAwareAdamW": (lambda m, **kw: InputAwareAdamW(m, lr=1e-3, **kw), "AdamW"),
    "FOOF": (lambda m, **kw: FOOF(m, lr=0.01, update_every=2, **kw), "SGD"),
    "KFAC": (lambda m, **kw: KFAC(m, lr=0.01, update_every=2, **kw), "SGD"),
    "NLMS": (lambda m, **kw: NLMS(m, lr=0.01, momentum=0.9, **kw), "SGD"),
    "LazyAdamW": (lambda m, **kw: LazyAdamW(m, lr=1e-3, **kw), "AdamW"),
    "DPSGD": (lambda m, **kw: DPSGD(m, lr=0.01, momentum=0.9, max_grad_norm=1.0, noise_multiplier=1.0, **kw), "SGD"),
    "DPAdamW": (lambda m, **kw: DPAdamW(m, lr=1e-3, max_grad_norm=1.0, noise_multiplier=1.0, **kw), "AdamW"),
    # (the layers it whitens: the embedding is not one, and is left out of its optimizer)
    "WhitenedMuon": (
        lambda m, **kw: WhitenedMuon(
            m, lr=1e-3, update_every=2, params=[*m.hidden.parameters(), *m.out.parameters()], **kw
        ),
        "SGD",
    ),
}


@dataclass
class Row:
    """One line of the table: a check, what it found, and the step time against stock."""

    check: str
    case: str
    ok: bool
    detail: str = ""
    ratio: float | None = None


@dataclass(frozen=True)
class Setup:
    """The device, the sizes and how carefully to time."""

    device: torch.device
    vocab: int
    dim: int
    hidden: int
    batch: int
    positions: int
    steps: int
    timing: Config
    compile_backend: str

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


class Net(nn.Module):
    """Embedding, two linear layers: every rule has a layer to act on."""

    def __init__(self, setup: Setup) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(setup.vocab, setup.dim)
        self.hidden = nn.Linear(setup.dim, setup.hidden)
        self.out = nn.Linear(setup.hidden, setup.dim)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(tokens)))).mean(1)


def _batches(setup: Setup, count: int) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, setup.vocab, (setup.batch, setup.positions), generator=generator).to(setup.device),
            torch.randn(setup.batch, setup.dim, generator=generator).to(setup.device),
        )
        for _ in range(count)
    ]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[Tensor, Tensor],
    scaler: torch.amp.GradScaler | None = None,
    poison: bool = False,
) -> None:
    """One step: forward (under float16 autocast when ``scaler`` is given), backward, step."""
    tokens, target = batch
    optimizer.zero_grad()
    device = tokens.device.type
    with torch.autocast(device, dtype=torch.float16, enabled=scaler is not None):
        loss = (model(tokens).float() - target).pow(2).mean()
    if poison:
        loss = loss * math.inf
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def _ratio(setup: Setup, ours: Callable[[], None], stock: Callable[[], None]) -> float:
    """The median per-step time of ``ours`` over ``stock``, timed in interleaved rounds."""

    def synchronized(step: Callable[[], None]) -> Callable[[], None]:
        def call() -> None:
            step()
            _synchronize(setup.device)

        return call

    timing = interleave({"stock": synchronized(stock), "ours": synchronized(ours)}, setup.timing)
    ratios = [a / b for a, b in zip(timing.seconds["ours"], timing.seconds["stock"], strict=True)]
    return sorted(ratios)[len(ratios) // 2]


def _cycling(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any], **kw: Any) -> Callable[[], None]:
    position = [0]

    def step() -> None:
        _train_step(model, optimizer, batches[position[0] % len(batches)], **kw)
        position[0] += 1

    return step


def _scaler(setup: Setup) -> torch.amp.GradScaler:
    return torch.amp.GradScaler(setup.device.type, init_scale=2.0**12, growth_interval=2)


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
    params = [p.detach().clone() for p in model.parameters()]
    state = [
        {k: v.clone() if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in optimizer.state[p].items()}
        for p in model.parameters()
    ]
    return [params, state]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# -- the checks --------------------------------------------------------------------------------
def check_kernels(setup: Setup) -> list[Row]:
    """Ours bitwise against stock for every kernel, plain and under GradScaler (a skipped step included)."""
    rows = []
    batches = _batches(setup, setup.steps)
    for stock_name, ours_cls in (("SGD", InputAwareSGD), ("AdamW", InputAwareAdamW)):
        for implementation, flags in IMPLEMENTATIONS.items():
            for scaled in (False, True):
                models = Net(setup).to(setup.device), Net(setup).to(setup.device)
                if stock_name == "SGD":
                    ours: torch.optim.Optimizer = ours_cls(models[0], lr=0.01, momentum=0.9, **flags)
                else:
                    ours = ours_cls(models[0], lr=1e-3, **flags)
                stock = STOCK[stock_name](models[1].parameters(), **flags)
                scalers = (_scaler(setup), _scaler(setup)) if scaled else (None, None)
                for i, batch in enumerate(batches):
                    poison = scaled and i == 1
                    _train_step(models[0], ours, batch, scalers[0], poison)
                    _train_step(models[1], stock, batch, scalers[1], poison)
                same = _same(_snapshot(models[0], ours), _snapshot(models[1], stock))
                if scaled:
                    same = same and scalers[0].get_scale() == scalers[1].get_scale()  # type: ignore[union-attr]
                ratio = _ratio(
                    setup,
                    _cycling(models[0], ours, batches, scaler=scalers[0]),
                    _cycling(models[1], stock, batches, scaler=scalers[1]),
                )
                case = f"{ours_cls.__name__} {implementation}" + (" +GradScaler" if scaled else "")
                rows.append(Row("kernels", case, same, "bitwise" if same else "differs from stock", ratio))
    return rows


class CallReader(InputAwareSGD):
    """Reads every captured call at ``step()`` (so they are kept) and records their arguments."""

    reads_calls = True

    @torch.no_grad()
    def step(self, closure: Any = None, inputs: Any = None) -> Any:
        self.seen = {self.capture.name(call.module): call.args[0] for call in inputs.calls}
        return super().step(closure, inputs=inputs)


def check_storage(setup: Setup) -> list[Row]:
    """``storage="cpu"``: pinned CPU copies, read correctly while the device is still busy."""
    model = Net(setup).to(setup.device)
    optimizer = CallReader(model, lr=0.01, momentum=0.9, storage="cpu")
    problems = []
    for tokens, target in _batches(setup, setup.steps):
        expected = tokens.to("cpu", copy=True)
        optimizer.zero_grad()
        if setup.cuda:
            torch.cuda._sleep(50_000_000)  # keep the stream busy: the copies finish after step() starts reading
        (model(tokens) - target).pow(2).mean().backward()
        tokens.fill_(0)  # overwritten on the device after the forward copied it
        optimizer.step()
        seen = optimizer.seen
        if set(seen) != {"embed", "hidden", "out"}:
            problems.append(f"captured {sorted(seen)}")
        if any(t.device.type != "cpu" for t in seen.values()):
            problems.append("a capture is not on the CPU")
        if setup.cuda and not all(t.is_pinned() for t in seen.values()):
            problems.append("a capture is not pinned")
        if "embed" in seen and not torch.equal(seen["embed"], expected):
            problems.append("the tokens read differ from the forward's")
    batches = _batches(setup, 2)
    stock_model = Net(setup).to(setup.device)
    ratio = _ratio(
        setup,
        _cycling(model, optimizer, batches),
        _cycling(stock_model, STOCK["SGD"](stock_model.parameters()), batches),
    )
    detail = "; ".join(dict.fromkeys(problems)) or ("pinned, asynchronous, as in the forward" if setup.cuda else "ok")
    return [Row("storage", 'storage="cpu" (call reader vs SGD)', not problems, detail, ratio)]


def check_amp(setup: Setup) -> list[Row]:
    """float16 autocast and GradScaler for every rule: overflowing steps skipped, the others finite."""
    rows = []
    batches = _batches(setup, setup.steps)
    poisoned = {1}
    for name, (make, stock_name) in RULES.items():
        model = Net(setup).to(setup.device)
        scaler = _scaler(setup)
        try:
            optimizer = make(model, grad_scaler=scaler)
            problems = []
            for i, batch in enumerate(batches):
                before = _snapshot(model, optimizer)
                scale = scaler.get_scale()
                _train_step(model, optimizer, batch, scaler, poison=i in poisoned)
                unchanged = _same(before, _snapshot(model, optimizer))
                if i in poisoned and not (unchanged and scaler.get_scale() < scale):
                    problems.append(f"step {i} overflowed but was not skipped")
                if i not in poisoned and unchanged:
                    problems.append(f"step {i} changed nothing")
            if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
                problems.append("non-finite parameters")
        except Exception as error:  # one failing rule must not hide the others
            rows.append(Row("amp", name, False, f"{type(error).__name__}: {error}"[:120]))
            continue
        stock_model, stock_scaler = Net(setup).to(setup.device), _scaler(setup)
        ratio = _ratio(
            setup,
            _cycling(model, optimizer, batches[:1], scaler=scaler),
            _cycling(stock_model, STOCK[stock_name](stock_model.parameters()), batches[:1], scaler=stock_scaler),
        )
        detail = "; ".join(problems) or f"step(s) {sorted(poisoned)} skipped"
        rows.append(Row("amp", f"{name} (vs {stock_name})", not problems, detail, ratio))
    return rows


def check_compile(setup: Setup) -> list[Row]:
    """Every rule on a compiled model: captures arrive and the parameters follow the eager run."""
    # The stock model timed beside ours has the same forward, so the same compiled code: with
    # hooks unguarded (Dynamo's default), ours would run the stock model's graph, without hooks.
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        return _compile_rows(setup)


def _compile_rows(setup: Setup) -> list[Row]:
    rows = []
    batches = _batches(setup, setup.steps)
    for name, (make, stock_name) in RULES.items():
        torch._dynamo.reset()  # each rule compiles afresh, never hitting the recompilation limit
        try:
            eager_model, model = Net(setup).to(setup.device), Net(setup).to(setup.device)
            eager, optimizer = make(eager_model), make(model)
            optimizer.load_state_dict(eager.state_dict())  # (DP: the same noise generator state for both runs)
            compiled = cast(nn.Module, torch.compile(model, backend=setup.compile_backend))
            for batch in batches:
                _train_step(eager_model, eager, batch)
                _train_step(compiled, optimizer, batch)
            with torch.no_grad():
                error = max(
                    float((p - q).abs().max() / q.abs().max().clamp(min=1e-12))
                    for p, q in zip(model.parameters(), eager_model.parameters(), strict=True)
                )
            ok = error < 1e-3
        except Exception as failure:
            rows.append(Row("compile", name, False, f"{type(failure).__name__}: {failure}"[:120]))
            continue
        stock_model = Net(setup).to(setup.device)
        stock_compiled = cast(nn.Module, torch.compile(stock_model, backend=setup.compile_backend))
        ratio = _ratio(
            setup,
            _cycling(compiled, optimizer, batches[:1]),
            _cycling(stock_compiled, STOCK[stock_name](stock_model.parameters()), batches[:1]),
        )
        rows.append(Row("compile", f"{name} (vs {stock_name})", ok, f"max relative gap to eager {error:.1e}", ratio))
    return rows


def check_gpt(setup: Setup) -> list[Row]:
    """The GPT section's configurations on the device, each step timed against AdamW's."""
    from . import gpt
    from .sections.gpt import ADAMW, DP, DROP_IN, EVA, FINDER, FOOF, KFAC, MONITOR, MUON, SGD, variants

    size = gpt.GPTSize(layers=6, width=384, context=256, batch=32) if setup.cuda else gpt.SIZES["quick"]
    tokens, targets = next(gpt.batches(size, seed=0))
    batch = (tokens.to(setup.device), targets.to(setup.device))
    table = variants(size)
    timing = Config(pairs=setup.timing.pairs, sample_seconds=0.5 if setup.cuda else 0.01, warmup_seconds=0.2)

    def training(name: str) -> tuple[Callable[[], None], list[Tensor]]:
        """One step of ``name`` on its own copy of the model, and the list that holds its last loss."""
        torch.manual_seed(0)
        model = gpt.build(size).to(setup.device)
        optimizer, kept = table[name].build(model)
        losses: list[Tensor] = []

        def step() -> None:
            optimizer.zero_grad()
            loss = gpt.loss(model, batch)
            loss.backward()
            optimizer.step()
            losses[:] = [loss.detach(), kept]  # (kept: a tool that must live as long as the step)
            _synchronize(setup.device)

        return step, losses

    rows = []
    stock = training(ADAMW)[0]
    for name in (SGD, MUON, DROP_IN, MONITOR, FINDER, EVA, FOOF, KFAC, DP):
        try:
            ours, losses = training(name)
            measured = interleave({"stock": stock, "ours": ours}, timing)
            finite = bool(torch.isfinite(losses[0]))
        except Exception as error:
            rows.append(Row("gpt", name, False, f"{type(error).__name__}: {error}"[:120]))
            continue
        ratios = sorted(a / b for a, b in zip(measured.seconds["ours"], measured.seconds["stock"], strict=True))
        adamw = sorted(measured.seconds["stock"])[len(ratios) // 2]
        detail = f"AdamW {1e3 * adamw:.1f} ms a step" if finite else "loss not finite"
        rows.append(Row("gpt", f"{name} (vs AdamW)", finite, detail, ratios[len(ratios) // 2]))
    return rows


def check_noise(setup: Setup) -> list[Row]:
    """DP's noise is drawn on the device of the parameters (a generator there), not on the CPU and copied."""
    rows = []
    for name in ("DPSGD", "DPAdamW"):
        make, _ = RULES[name]
        model = Net(setup).to(setup.device)
        optimizer = make(model)
        generator = optimizer.rules[0]._generator
        _train_step(model, optimizer, _batches(setup, 1)[0])
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        on_device = generator.device.type == setup.device.type
        rows.append(Row("noise", name, on_device and finite, f"generator on {generator.device}"))
    return rows


RUNNERS: dict[str, Callable[[Setup], list[Row]]] = {
    "noise": check_noise,
    "kernels": check_kernels,
    "storage": check_storage,
    "amp": check_amp,
    "compile": check_compile,
    "gpt": check_gpt,
}


def table(rows: list[Row]) -> str:
    """The report: one line per row, the step-time ratio last."""
    header = ("check", "case", "result", "step time vs stock", "detail")
    lines = [
        (r.check, r.case, "ok" if r.ok else "FAIL", "-" if r.ratio is None else f"{r.ratio:.2f}x", r.detail)
        for r in rows
    ]
    widths = [max(len(str(line[i])) for line in [header, *lines]) for i in range(len(header))]
    out = [" | ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in [header, *lines]]
    out.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a dry run")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, of: {', '.join(CHECKS)}")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default: inductor)")
    parser.add_argument("--steps", type=int, default=4, help="steps per correctness check (default: 4)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default: 5)")
    return parser


def setup_for(device: torch.device, steps: int, rounds: int, compile_backend: str) -> Setup:
    """Sizes that make step times meaningful on a GPU and a dry run quick on the CPU."""
    big = device.type == "cuda"
    return Setup(
        device=device,
        vocab=4096 if big else 40,
        dim=256 if big else 8,
        hidden=1024 if big else 16,
        batch=64 if big else 4,
        positions=64 if big else 5,
        steps=steps,
        timing=Config(pairs=rounds, sample_seconds=0.02 if big else 0.002, warmup_seconds=0.05 if big else 0.005),
        compile_backend=compile_backend,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = [c for c in checks if c not in RUNNERS]
    if unknown:
        print(f"unknown checks: {', '.join(unknown)} (choose from {', '.join(CHECKS)})", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check skipped: no CUDA (torch.cuda.is_available() is False); --device cpu runs a dry run")
        return 0
    if args.steps < 2:
        print("--steps must be >= 2 (step 1 overflows on purpose)", file=sys.stderr)
        return 2
    setup = setup_for(device, args.steps, max(1, args.rounds), args.compile_backend)
    name = torch.cuda.get_device_name(device) if setup.cuda else "CPU (dry run)"
    print(f"gpu_check on {name}, torch {torch.__version__}: {', '.join(checks)}")
    rows: list[Row] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CoverageWarning)  # the embedding takes the stock step under FOOF/KFAC/NLMS
        for check in checks:
            rows += RUNNERS[check](setup)
    print(table(rows))
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)} of {len(rows)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
