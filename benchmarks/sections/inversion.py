"""Inverting Kronecker factors: Cholesky or a kept eigendecomposition, float64 or float32; cost and error."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from inputaware_optim.inverses import damped_inverse, eigenbasis, inverse_from_eigenbasis

from ..core import Config, Progress, Result, Section, Table, Target, format_seconds
from ..timing import interleave

BASELINE = "Cholesky float64"
CHOLESKY32 = "Cholesky float32"
EIGH64, EIGH32 = "eigh float64", "eigh float32"
REDAMP = "new damping from a kept eigh (float64)"
VARIANTS = (BASELINE, CHOLESKY32, EIGH64, EIGH32, REDAMP)
# Damping relative to the factor's mean eigenvalue: the library's default (0.1 on standardized
# inputs) is near the top; 1e-3 is the ill-conditioned end where float32 is tested hardest.
RELATIVE_DAMPINGS = (1e-1, 1e-3)
ERROR_LIMIT = 1e-5
REDAMP_LIMIT = 0.25
TARGET_SIZE = 257


def factor(size: int, seed: int) -> Tensor:
    """A second moment like a layer's input statistics: ``xᵀx / rows`` of ``4 · size`` rows whose
    feature scales fall off as ``1 / (1 + i)`` (a decaying spectrum, condition ~ size² undamped)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * size, size, generator=generator) / (1.0 + torch.arange(size))
    return x.T @ x / x.shape[0]


def relative_error(moment: Tensor, damping: float, inverse: str, dtype: torch.dtype, seed: int) -> float:
    """``|G A⁻¹ − G A⁻¹_exact| / |G A⁻¹_exact|`` for a random gradient G, against a float64 solve."""
    size = moment.shape[-1]
    grad = torch.randn(size, size, generator=torch.Generator().manual_seed(seed + 1))
    damped = moment.double() + damping * torch.eye(size, dtype=torch.float64)
    exact = torch.linalg.solve(damped, grad.double().T).T  # G A⁻¹ (A symmetric)
    if inverse == "cholesky":
        got = damped_inverse(moment, damping, "factor", dtype=dtype)
    else:
        packed = eigenbasis(moment, "factor", dtype)
        got = inverse_from_eigenbasis(packed[-1], packed[:-1], damping, "factor", moment.dtype)
    return float((grad @ got).double().sub(exact).norm() / exact.norm())


def run(config: Config, progress: Progress) -> Result:
    sizes = config.pick((16, 64), (65, 129, TARGET_SIZE, 513))
    progress.start(len(sizes))
    timing_rows, error_rows, targets = [], [], []
    data: dict[str, Any] = {"sizes": list(sizes), "relative_dampings": list(RELATIVE_DAMPINGS), "by_size": {}}
    for size in sizes:
        progress.describe(f"factor {size}")
        moment = factor(size, config.seed)
        damping = RELATIVE_DAMPINGS[0] * float(moment.diagonal().mean())
        calls = _calls(moment, damping)
        timing = interleave(calls, config)
        ratios = {name: timing.ratio(name, BASELINE) for name in VARIANTS}
        redamp_vs_eigh = timing.ratio(REDAMP, EIGH64)
        for name in VARIANTS:
            timing_rows.append([str(size), name, format_seconds(timing.per_call(name)), ratios[name].shown()])
        errors = {
            f"{inverse} {str(dtype).removeprefix('torch.')} at {relative:g}": relative_error(
                moment, relative * float(moment.diagonal().mean()), inverse, dtype, config.seed
            )
            for relative in RELATIVE_DAMPINGS
            for inverse in ("cholesky", "eigh")
            for dtype in (torch.float64, torch.float32)
        }
        error_rows += [[str(size), name, f"{error:.2e}"] for name, error in errors.items()]
        data["by_size"][str(size)] = {
            "timing": timing.to_json(),
            "ratios_vs_cholesky_float64": {name: ratio.__dict__ for name, ratio in ratios.items()},
            "redamp_vs_eigh": redamp_vs_eigh.__dict__,
            "relative_errors": errors,
        }
        if size == config.pick(sizes[-1], TARGET_SIZE):
            targets.append(
                Target.at_most(
                    f"A damping change with inverse='eigh' (the kept decomposition) vs a new eigendecomposition, "
                    f"factor {size}",
                    redamp_vs_eigh.median,
                    REDAMP_LIMIT,
                    "×",
                    f"pairs {redamp_vs_eigh.low:.3f}–{redamp_vs_eigh.high:.3f}; against a Cholesky refresh "
                    f"{ratios[REDAMP].median:.2f}×",
                ).full_size_only(config)
            )
        progress.advance()
    errors = [
        (error, name, size) for size in sizes for name, error in data["by_size"][str(size)]["relative_errors"].items()
    ]
    cholesky32 = max(e for e in errors if e[1].startswith("cholesky float32"))
    eigh32 = max(e for e in errors if e[1].startswith("eigh float32"))
    exact = max(e for e in errors if "float64" in e[1])
    targets.append(
        Target.at_most(
            "float32 Cholesky inverses: relative error of the preconditioned gradient, every size and damping",
            cholesky32[0],
            ERROR_LIMIT,
            "",
            f"worst at factor {cholesky32[2]}, damping {cholesky32[1].split()[-1]} × the mean eigenvalue; float64 "
            f"decompositions {exact[0]:.1e} (the float32 result's own rounding); eigh in float32 is far less "
            f"exact: {eigh32[0]:.1e} at factor {eigh32[2]}, damping {eigh32[1].split()[-1]}",
        )
    )
    tables = [
        Table(
            "Inverting one damped factor: time per inverse, ratio vs Cholesky in float64 (the default)",
            ["factor size", "method", "time", "ratio vs Cholesky float64"],
            timing_rows,
            "Cholesky: factor and invert (`damped_inverse`); eigh: decompose and form Q diag(1/(λ+γ)) Qᵀ "
            "(`eigenbasis`, `inverse_from_eigenbasis`); the last row forms the inverse at a new damping from a "
            "kept decomposition, the whole cost of a damping change under `inverse='eigh'`. Damping γ = "
            f"{RELATIVE_DAMPINGS[0]:g} × the mean eigenvalue. CPU LAPACK, with the run's torch threads.",
        ),
        Table(
            "Error of the preconditioned gradient G (A + γI)⁻¹ against a float64 solve",
            ["factor size", "method, precision, damping relative to the mean eigenvalue", "relative error"],
            error_rows,
            "Frobenius norm of the difference over the norm of the exact product, for a random G; the factor's "
            "undamped condition number grows as size², so the small damping is the hard case for float32.",
        ),
    ]
    return Result(tables=tables, targets=targets, data=data)


def _calls(moment: Tensor, damping: float) -> dict[str, Any]:
    """Each method's inversion of ``moment`` at ``damping``, as a call to time."""
    kept = eigenbasis(moment, "factor", torch.float64)

    def eigh(dtype: torch.dtype) -> Tensor:
        packed = eigenbasis(moment, "factor", dtype)
        return inverse_from_eigenbasis(packed[-1], packed[:-1], damping, "factor", moment.dtype)

    return {
        BASELINE: lambda: damped_inverse(moment, damping, "factor"),
        CHOLESKY32: lambda: damped_inverse(moment, damping, "factor", dtype=torch.float32),
        EIGH64: lambda: eigh(torch.float64),
        EIGH32: lambda: eigh(torch.float32),
        REDAMP: lambda: inverse_from_eigenbasis(kept[-1], kept[:-1], 2 * damping, "factor", moment.dtype),
    }


SECTION = Section(
    name="inversion",
    title="Inverting Kronecker factors: Cholesky or eigendecomposition, float64 or float32",
    summary=(
        "FOOF and K-FAC refresh a damped inverse of each factor every `update_every` statistics steps: by "
        "Cholesky (`inverse='cholesky'`, the default) or from an eigendecomposition they keep "
        "(`inverse='eigh'`), whose point is that a change of damping (a schedule, or a rule that adapts it) "
        "then costs one matrix product instead of a new decomposition; either in float64 (the default) or "
        "float32 (`inverse_dtype`). Each method is timed interleaved against Cholesky in float64 on factors "
        "of the sizes these models have, with a decaying spectrum like a layer's input statistics, and the "
        "error each gives the preconditioned gradient is measured against a float64 solve."
    ),
    run=run,
    estimate=(2, 25),
)
