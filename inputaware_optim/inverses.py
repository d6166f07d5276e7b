"""The damped inverses of the Kronecker rules' factors, and the one contract every rule's inverse keeps: a damped
matrix is inverted only if its smallest eigenvalue exceeds ``ROUNDING_MARGIN`` ε times its largest (its condition
number ``μ_max / μ_min`` below ``condition_limit``), ε the machine epsilon of the dtypes its statistics were kept,
inverted and applied in. Any other (not positive definite, too near singular for those dtypes, or not finite) is
refused, naming the layer, the damping and what to do, before anything changes."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "INVERSES",
    "ROUNDING_MARGIN",
    "Check",
    "condition",
    "condition_limit",
    "damped_inverse",
    "eigenbasis",
    "eigenvalue_condition",
    "inverse_from_eigenbasis",
    "kronecker_condition",
    "refuse_any",
    "refuse_ill_conditioned",
]

# The smallest eigenvalue of a damped matrix must exceed this many times ε times its largest. At the limit, the
# rounding of the statistics and of the gradient moved the preconditioned gradient by up to 5% of itself against
# float64 arithmetic (float64 decompositions; 18% float32 ones: rank-deficient float32 inputs, factors 2 to 200
# wide), and by proportionally less above it.
ROUNDING_MARGIN = 10.0


def condition_limit(*dtypes: torch.dtype) -> float:
    """The condition number ``μ_max / μ_min`` a damped matrix must stay below to be inverted:
    ``1 / (ROUNDING_MARGIN · ε)``, ε the machine epsilon of the coarsest of ``dtypes`` (those its statistics
    were kept, decomposed and applied in): 8.4e5 with float32, 4.5e14 with float64 alone. Each entry is known
    to ε of itself, so each eigenvalue only to about ε times the largest, and an inverse divides the gradient
    (its rounding included) by them: beyond the limit, the step is rounding."""
    return 1.0 / (ROUNDING_MARGIN * max(torch.finfo(dtype).eps for dtype in dtypes))


def eigenvalue_condition(eigenvalues: Tensor, dims: int = 1) -> Tensor:
    """``μ_max / μ_min`` of a matrix from its eigenvalues (its last ``dims`` dimensions; one per block), in float64:
    infinite if one is not positive."""
    flat = eigenvalues.double().flatten(-dims) if dims > 1 else eigenvalues.double()
    smallest = flat.amin(-1)
    return torch.where(smallest > 0, flat.amax(-1) / smallest, torch.inf)


def condition(matrix: Tensor, damping: float | Tensor, inverse: Tensor | None = None) -> Tensor:
    """``μ_max / μ_min`` of ``matrix + damping·I`` (``matrix`` a second moment, its eigenvalues below 0 rounding,
    taken as 0 as ``eigenbasis`` does; one per block), in float64: exact (an eigenvalue decomposition), or given
    the inverse, the cheap upper bound ``(λ + ‖F‖_F) / max(λ, 1 / ‖M⁻¹‖_F)``."""
    damping = torch.as_tensor(damping, dtype=torch.float64, device=matrix.device)
    if inverse is None:
        return eigenvalue_condition(torch.linalg.eigvalsh(matrix.double()).clamp_min(0) + damping[..., None])
    largest = damping + torch.linalg.matrix_norm(matrix, dtype=torch.float64)
    return largest / torch.maximum(damping, 1 / torch.linalg.matrix_norm(inverse, dtype=torch.float64))


def refuse_ill_conditioned(
    conditions: Tensor,
    dtypes: tuple[torch.dtype, ...],
    name: str,
    damping: float | Tensor,
    given: float | None = None,
) -> None:
    """Refuse a damped matrix whose ``conditions`` (one per block) are not below ``condition_limit(*dtypes)``.

    Raises:
        RuntimeError: Naming ``name`` and the damping (``given``: the hyperparameter it was derived from).
    """
    limit = condition_limit(*dtypes)
    if not bool((conditions < limit).all()):
        coarsest = max(dtypes, key=lambda dtype: torch.finfo(dtype).eps)
        raise _NotPositiveDefinite(
            name,
            _said(damping, given),
            f" to within their rounding error: their smallest eigenvalue is below their rounding error in {coarsest} "
            f"times {ROUNDING_MARGIN:g} (condition number μ_max / μ_min {float(conditions.max()):.3g}, the limit "
            f"{limit:.3g}), where the step would be rounding noise. If training is diverging, lower the learning "
            "rate; else increase damping.",
        )


def damped_inverse(
    matrix: Tensor,
    damping: float | Tensor,
    name: str,
    *,
    dtype: torch.dtype = torch.float64,
    given: float | None = None,
    checked: bool = True,
) -> Tensor:
    """:math:`(M + \\lambda I)^{-1}` by Cholesky in ``dtype``, returned in ``matrix``'s dtype, row-major (so
    a product with it takes the same kernel, the same bits, wherever it was computed). ``damping`` is a
    number, or one per block; ``given`` the hyperparameter it was derived from, if it differs (an error
    names both). ``checked=False`` leaves the checks to a caller that inverts a product of it (``Check``): no
    host read, and the inverse is NaN where the factorization failed.

    Raises:
        RuntimeError: If the damped matrix is not positive definite, or (``checked``) its condition number is
            not below ``condition_limit`` in ``matrix``'s dtype and ``dtype``, as ``inverse_from_eigenbasis``.
    """
    damped = matrix.to(dtype, copy=True)
    # (one pass: no identity formed; a damping per block is one per diagonal)
    damped.diagonal(dim1=-2, dim2=-1).add_(_per_block(damping))
    factor, info = torch.linalg.cholesky_ex(damped)
    dtypes = (matrix.dtype, dtype)
    if not checked:  # the caller checks the inverse (NaN where the factorization failed): no read here
        failed = (info != 0)[..., None, None]
        identity = torch.eye(factor.shape[-1], dtype=factor.dtype, device=factor.device)
        inverse = torch.cholesky_inverse(torch.where(failed, identity, factor)).mT  # (a failed factor, replaced)
        return torch.where(failed, torch.nan, inverse).to(matrix.dtype)
    if bool(info.any()):
        _refuse_not_finite(matrix, name)
        refuse_ill_conditioned(torch.tensor(torch.inf), dtypes, name, damping, given)
    # Column-major out of LAPACK and exactly symmetric: its transpose is the row-major inverse, with no copy.
    inverse = torch.cholesky_inverse(factor).mT
    refuse_ill_conditioned(kronecker_condition([(matrix, damping, inverse)], dtypes), dtypes, name, damping, given)
    return inverse.to(matrix.dtype)


def kronecker_condition(
    factors: Sequence[tuple[Tensor, float | Tensor, Tensor]], dtypes: tuple[torch.dtype, ...]
) -> Tensor:
    """The condition number of the Kronecker product of the damped ``(matrix, damping, inverse)`` factors (the
    product of theirs; one factor: its own): the cheap upper bound from their inverses where that is half the
    limit or less (room for the inverses' rounding), else exactly (eigenvalue decompositions, near the limit)."""
    bound = torch.stack([condition(matrix, damping, inverse) for matrix, damping, inverse in factors]).prod(0)
    if bool((2 * bound < condition_limit(*dtypes)).all()):
        return bound
    return torch.stack([condition(matrix, damping) for matrix, damping, _ in factors]).prod(0)


class Check(NamedTuple):
    """A matrix a step inverts, to be checked before any change (``refuse_any``): ``conditions`` (per block) its
    condition number or an upper bound of it (NaN where an inversion failed), ``exact`` the exact one where that is a
    bound (computed only near the limit), ``dtypes`` those its statistics were kept, inverted and applied in."""

    conditions: Tensor
    exact: Callable[[], Tensor] | None
    dtypes: tuple[torch.dtype, ...]
    name: str
    damping: float
    statistics: Sequence[Tensor]
    failed: Callable[[], None] | None = None  # where an inversion failed: raises saying which, with what damping


def refuse_any(checks: Sequence[Check]) -> None:
    """Refuse, naming its layer, the first matrix of ``checks`` whose condition number is not below
    ``condition_limit`` (or whose inversion failed): one host read for all of them, a second only near the limit.

    Raises:
        RuntimeError: As ``refuse_ill_conditioned``, or if the statistics are not finite.
    """
    if not checks:
        return
    worst = torch.stack([check.conditions.double().amax() for check in checks]).tolist()
    for check, value in zip(checks, worst, strict=True):
        limit = condition_limit(*check.dtypes)
        if value < (limit / 2 if check.exact is not None else limit):  # (a bound: room for its rounding)
            continue
        if math.isnan(value):  # an inversion failed: not finite, or not positive definite
            for matrix in check.statistics:
                _refuse_not_finite(matrix, check.name)
            if check.failed is not None:
                check.failed()
            conditions = torch.tensor(torch.inf)
        else:
            conditions = check.exact() if check.exact is not None else check.conditions
        refuse_ill_conditioned(conditions, check.dtypes, check.name, check.damping)


class _NotPositiveDefinite(RuntimeError):
    """A damped factor that cannot be inverted (a ``RuntimeError`` to the user); ``why`` says what to do."""

    def __init__(self, name: str, said: str, why: str) -> None:
        message = f"the damped statistics of {name} are not positive definite ({said}){why}"
        super().__init__(f"{message} No parameter was changed by this step")


INVERSES = ("cholesky", "eigh")  # how a Kronecker rule inverts its damped factors


def eigenbasis(matrix: Tensor, name: str, dtype: torch.dtype = torch.float64) -> Tensor:
    """The eigendecomposition of a symmetric ``matrix`` (or of each block) in ``dtype``, packed as
    the eigenvectors' ``n`` rows (each column one vector), then the eigenvalues as row ``n`` (those
    below zero, rounding: the statistics are second moments, as 0).

    Raises:
        RuntimeError: If the statistics are not finite, or the decomposition does not converge.
    """
    _refuse_not_finite(matrix, name)
    values, vectors = torch.linalg.eigh(matrix.to(dtype))
    return torch.cat([vectors, values.clamp_min(0).unsqueeze(-2)], dim=-2)


def inverse_from_eigenbasis(
    values: Tensor,
    vectors: Tensor,
    damping: float | Tensor,
    name: str,
    dtype: torch.dtype,
    given: float | None = None,
    *,
    checked: bool = True,
    power: float = -1.0,
) -> Tensor:
    """:math:`Q\\,\\mathrm{diag}((\\lambda_i + \\text{damping})^{p})\\,Q^\\top` in ``dtype``, row-major, with
    ``p = power``: the damped inverse (-1, the default) or its inverse square root (-1/2) (``damping`` a number, or
    one per block; ``given`` the hyperparameter it was derived from). ``checked=False`` leaves the condition number
    to a caller that inverts a product of it; the contract is the damped matrix's, whatever the power.

    Raises:
        RuntimeError: If (``checked``) the damped matrix's condition number is not below ``condition_limit`` in
            ``values``' dtype and ``dtype`` (damping 0 on a singular factor, or too small), as ``damped_inverse``.
    """
    shifted = values + torch.as_tensor(damping, dtype=values.dtype, device=values.device)[..., None]
    if checked:
        refuse_ill_conditioned(eigenvalue_condition(shifted), (values.dtype, dtype), name, damping, given)
    if power == -1.0:
        return ((vectors / shifted.unsqueeze(-2)) @ vectors.mT).to(dtype).contiguous()
    return ((vectors * shifted.pow(power).unsqueeze(-2)) @ vectors.mT).to(dtype).contiguous()


def _per_block(damping: float | Tensor) -> float | Tensor:
    return damping[..., None] if isinstance(damping, Tensor) else damping


def _said(damping: float | Tensor, given: float | None) -> str:
    """The damping as an error names it: the hyperparameter, and what was added if that differs."""
    if given is None or (not isinstance(damping, Tensor) and damping == given):
        return f"damping={float(damping):g}" if not isinstance(damping, Tensor) else f"damping={damping.tolist()}"
    added = ", ".join(f"{float(v):.3g}" for v in torch.as_tensor(damping).reshape(-1)[:4])
    return f"damping={float(given):g}, added to this factor's diagonal as {added}"


def _refuse_not_finite(matrix: Tensor, name: str) -> None:
    if not bool(torch.isfinite(matrix).all()):
        raise RuntimeError(
            f"the statistics of {name} are not finite: training has diverged (NaN or inf activations "
            "or gradients). Lower the learning rate. No parameter was changed by this step"
        )
