"""Section: the rules across gloo ranks: K-FAC's step and inversion time per rank, and the bytes each rule sends."""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core import Config, Progress, Result, Section, Table, Target, format_seconds

DAMPING = 0.1
TIMEOUT = 600.0  # seconds for one multi-process run


# -- the ranks --------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, port: int, task: str, options: dict[str, Any], out: str) -> None:
    """One rank: join the gloo group, run ``task``, write its JSON, leave without torch's teardown."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT))
    result = TASKS[task](rank, world, options)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    # torch 2.13's gloo teardown may abort a finished rank (see tests/multiprocess.py): every
    # result is written, so leave without it.
    os._exit(0)


def _launch(world: int, task: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    """Run ``task`` on ``world`` spawned gloo ranks; each rank's result, by rank."""
    import multiprocessing.connection

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as out:
        processes = [
            context.Process(target=_rank_main, args=(rank, world, port, task, options, out)) for rank in range(world)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + TIMEOUT
        while any(p.exitcode is None for p in processes) and time.monotonic() < deadline:
            multiprocessing.connection.wait([p.sentinel for p in processes if p.exitcode is None], timeout=1.0)
            if any(p.exitcode not in (None, 0) for p in processes):
                break
        for process in processes:
            if process.exitcode is None:
                process.terminate()
            process.join(10)
        files = [Path(out, f"rank{rank}.json") for rank in range(world)]
        if not all(f.is_file() for f in files):
            codes = [p.exitcode for p in processes]
            raise RuntimeError(f"{task} on {world} ranks failed (exit codes {codes})")
        return [json.loads(f.read_text()) for f in files]


def _mlp(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def kfac_times(rank: int, world: int, options: dict[str, Any]) -> dict[str, Any]:
    """Per step on this rank: wall time, and CPU time spent inverting factors (inverses refreshed every step)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from inputaware_optim import KFAC, kronecker

    inverting = [0.0, 0]
    original = kronecker.damped_inverse

    def timed(matrix: torch.Tensor, damping: float, name: str, **options: Any) -> torch.Tensor:
        start = time.thread_time()
        inverse = original(matrix, damping, name, **options)
        inverting[0] += time.thread_time() - start
        inverting[1] += 1
        return inverse

    kronecker.damped_inverse = timed  # instrumentation: the step calls it through the module
    model = DistributedDataParallel(_mlp(options["width"], options["depth"]))
    optimizer = KFAC(
        model, lr=0.01, damping=DAMPING, update_every=1, distributed_inversion=options["distributed_inversion"]
    )
    data = torch.Generator().manual_seed(rank)
    batch = options["batch"]
    walls, cpus, counts = [], [], []
    for step in range(options["warmup"] + options["steps"]):
        x, y = torch.randn(batch, options["width"], generator=data), torch.randint(0, 10, (batch,), generator=data)
        dist.barrier()  # every rank starts the step together
        inverting[:] = [0.0, 0]
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if step >= options["warmup"]:
            walls.append(time.perf_counter() - start)
            cpus.append(inverting[0])
            counts.append(inverting[1])
    kronecker.damped_inverse = original
    return {
        "step_seconds": statistics.median(walls),
        "inversion_cpu_seconds": statistics.median(cpus),
        "inversions": statistics.median(counts),
    }


class _Net(nn.Module):
    """Embedding and two linear layers: every rule has a layer to act on."""

    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(1000, width)
        self.hidden = nn.Linear(width, 2 * width)
        self.out = nn.Linear(2 * width, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(tokens)))).mean(1)


def _rules() -> dict[str, Callable[[nn.Module], torch.optim.Optimizer]]:
    from inputaware_optim import DPSGD, FOOF, KFAC, NLMS, InputAwareSGD, LazyAdamW

    return {
        "InputAwareSGD": lambda m: InputAwareSGD(m, lr=0.01),
        "FOOF": lambda m: FOOF(m, lr=0.01),
        "FOOF (distributed inversion)": lambda m: FOOF(m, lr=0.01, distributed_inversion=True),
        "KFAC": lambda m: KFAC(m, lr=0.01, damping=DAMPING),
        "KFAC (distributed inversion)": lambda m: KFAC(m, lr=0.01, damping=DAMPING, distributed_inversion=True),
        "NLMS": lambda m: NLMS(m, lr=0.01),
        "LazyAdamW": lambda m: LazyAdamW(m, lr=1e-3),
        "DPSGD": lambda m: DPSGD(m, lr=0.01, noise_multiplier=1.0, expected_batch_size=8),
    }


def rule_bytes(rank: int, world: int, options: dict[str, Any]) -> dict[str, Any]:
    """Bytes each rule sends per step (averaged over ``update_every`` steps), under DDP and FSDP2."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from inputaware_optim import CoverageWarning, dp, kronecker

    sent = [0]

    def counting(function: Callable[..., Any], size: Callable[..., int]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            sent[0] += size(*args)
            return function(*args, **kwargs)

        return counted

    def payload(t: torch.Tensor, *rest: Any) -> int:
        return t.numel() * t.element_size()

    # Instrumentation: the rules' own collectives. The engines' (DDP's reducer, FSDP2's all-gathers
    # and reduce-scatters) are not counted; the gradient's size stands beside them for scale.
    dist.all_reduce = counting(dist.all_reduce, payload)  # type: ignore[assignment]
    dist.broadcast = counting(dist.broadcast, payload)  # type: ignore[assignment]
    kronecker.full_matrix_rows = counting(  # type: ignore[assignment]
        kronecker.full_matrix_rows,
        lambda w, b, homogeneous: (w.numel() + (b.numel() if homogeneous and b is not None else 0)) * w.element_size(),
    )
    dp.reduce_scatter_like = counting(dp.reduce_scatter_like, payload)  # type: ignore[assignment]
    warnings.simplefilter("ignore", CoverageWarning)
    mesh = init_device_mesh("cpu", (world,))
    data = torch.Generator().manual_seed(rank)
    steps = options["steps"]
    out: dict[str, Any] = {}
    for name, make in _rules().items():
        for engine in ("DDP", "FSDP2"):
            net = _Net(options["width"])
            model: nn.Module = net
            if engine == "DDP":
                model = DistributedDataParallel(net)
            else:
                for layer in (net.embed, net.hidden, net.out):
                    fully_shard(layer, mesh=mesh)
                fully_shard(net, mesh=mesh)
            optimizer = make(model)
            sent[0] = 0
            for _ in range(steps):
                tokens = torch.randint(0, 1000, (8, 6), generator=data)
                optimizer.zero_grad()
                model(tokens).pow(2).mean().backward()
                optimizer.step()
            out[f"{name}|{engine}"] = sent[0] / steps
    out["gradient"] = sum(p.numel() * p.element_size() for p in _Net(options["width"]).parameters())
    return out


def measure(rank: int, world: int, options: dict[str, Any]) -> dict[str, Any]:
    """One launch per number of ranks: K-FAC's times both ways, then (if asked) the bytes per rule."""
    out: dict[str, Any] = {}
    for shared in (False, True):
        out[f"kfac_times|{shared}"] = kfac_times(rank, world, {**options, "distributed_inversion": shared})
    if options.get("bytes"):  # last: it patches the collectives to count them
        out["rule_bytes"] = rule_bytes(rank, world, options["bytes"])
    return out


TASKS: dict[str, Callable[[int, int, dict[str, Any]], dict[str, Any]]] = {"measure": measure}


# -- the section --------------------------------------------------------------------------------
def _bytes(n: float) -> str:
    for unit, scale in (("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def run(config: Config, progress: Progress) -> Result:
    worlds = config.pick((2,), (1, 2, 4))
    options = {
        "width": config.pick(32, 192),
        "depth": config.pick(2, 4),
        "batch": config.pick(16, 64),
        "warmup": config.pick(1, 3),
        "steps": config.pick(3, 15),
    }
    byte_options = {"width": config.pick(16, 64), "steps": 10}
    progress.start(len(worlds))
    times: dict[str, Any] = {}
    rows = []
    sent: dict[str, Any] = {}
    for world in worlds:
        progress.describe(f"{world} rank(s)")
        launched = _launch(world, "measure", {**options, "bytes": byte_options if world == 2 else None})
        sent = launched[0].get("rule_bytes", sent)
        progress.advance()
        for shared in (False, True):
            per_rank = [r[f"kfac_times|{shared}"] for r in launched]
            key = f"{world} ranks, {'distributed' if shared else 'every rank'} inversion"
            times[key] = {"world": world, "distributed_inversion": shared, "ranks": per_rank}
            step = max(r["step_seconds"] for r in per_rank)
            cpu = max(r["inversion_cpu_seconds"] for r in per_rank)
            inversions = max(r["inversions"] for r in per_rank)
            rows.append(
                [
                    str(world),
                    "one rank per factor" if shared else "every rank, every factor",
                    format_seconds(step),
                    format_seconds(cpu),
                    f"{inversions:g}",
                ]
            )
    gradient = sent.pop("gradient")
    names = list(dict.fromkeys(key.split("|")[0] for key in sent))
    byte_rows = [[name, _bytes(sent[f"{name}|DDP"]), _bytes(sent[f"{name}|FSDP2"]), _bytes(gradient)] for name in names]

    def inversion_cpu(world: int, shared: bool) -> float:
        entry = times[f"{world} ranks, {'distributed' if shared else 'every rank'} inversion"]
        return max(r["inversion_cpu_seconds"] for r in entry["ranks"])

    most = worlds[-1]
    share = inversion_cpu(most, True) / max(inversion_cpu(most, False), 1e-12)
    targets = [
        Target.at_most(
            f"K-FAC inversion CPU time per rank at {most} ranks with distributed inversion",
            share,
            0.75,
            "× one rank's",
            f"the busiest rank's CPU time in damped_inverse per step, {most} gloo ranks with "
            "distributed_inversion=True, against the same ranks each inverting every factor (as one process "
            "does; inverses refreshed every step)",
        ).full_size_only(config)
    ]
    tables = [
        Table(
            f"K-FAC across gloo ranks (DDP; MLP of {options['depth']} × {options['width']}-wide layers, "
            f"local batch {options['batch']}, inverses refreshed every step)",
            ["ranks", "who inverts", "step time (slowest rank)", "inversion CPU time (busiest rank)", "inversions"],
            rows,
            "Medians over the timed steps; each step starts at a barrier. Inversion CPU time is the thread time "
            "inside damped_inverse. The ranks share this machine's cores, so step times at more ranks than "
            "cores measure the contention too; the inversion CPU time and count are the per-rank work.",
        ),
        Table(
            "Bytes a rule sends per step beyond the engine's own traffic (2 ranks, averaged over 10 steps, "
            "update_every=10)",
            ["rule", "DDP", "FSDP2", "gradient (engine traffic scale)"],
            byte_rows,
            "Counted at the rule's own collectives (all-reduce, broadcast, K-FAC's gather of a layer's gradient "
            "under FSDP2, DP's reduce-scatter) as the payload handed to them. DDP all-reduces the whole gradient "
            "each step; FSDP2 reduce-scatters it and all-gathers the parameters. DP's DDP path sums in float64 "
            "(twice the float32 gradient); its FSDP2 path reduce-scatters in the gradient's dtype.",
        ),
    ]
    data = {"options": options, "kfac_times": times, "bytes_per_step": sent, "gradient_bytes": gradient}
    return Result(tables=tables, targets=targets, data=data)


SECTION = Section(
    name="distributed",
    title="Across ranks: K-FAC's distributed inversion, and what each rule communicates",
    summary=(
        "Spawned gloo ranks on this machine. K-FAC under DDP with every rank inverting every factor, and "
        "with `distributed_inversion=True` (each factor inverted on one rank and broadcast), at 1, 2 and 4 "
        "ranks: step time and the inversion work per rank. Then, for each rule under DDP and FSDP2, the bytes "
        "its own collectives carry per step, beside the gradient's size."
    ),
    run=run,
    estimate=(7, 35),
)
