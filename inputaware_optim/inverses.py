"""The damped inverses of the Kronecker rules' factors, and the one refusal they share: a factor that cannot be
inverted at its damping (not positive definite, or not finite) is refused, naming the layer and what to do."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["INVERSES", "damped_inverse", "eigenbasis", "inverse_from_eigenbasis"]


def damped_inverse(
    matrix: Tensor,
    damping: float | Tensor,
    name: str,
    *,
    dtype: torch.dtype = torch.float64,
    given: float | None = None,
) -> Tensor:
    """:math:`(M + \\lambda I)^{-1}` by Cholesky in ``dtype``, returned in ``matrix``'s dtype, row-major (so
    a product with it takes the same kernel, the same bits, wherever it was computed). ``damping`` is a
    number, or one per block; ``given`` the hyperparameter it was derived from, if it differs (an error
    names both).

    Raises:
        RuntimeError: If the damped matrix is not positive definite (damping too small).
    """
    damped = matrix.to(dtype, copy=True)
    # (one pass: no identity formed; a damping per block is one per diagonal)
    damped.diagonal(dim1=-2, dim2=-1).add_(damping[..., None] if isinstance(damping, Tensor) else damping)
    factor, info = torch.linalg.cholesky_ex(damped)
    if bool(info.any()):
        _refuse_not_finite(matrix, name)
        said = _said(damping, given)
        largest = float(matrix.abs().max())
        if bool((torch.as_tensor(damping) < largest * matrix.shape[-1] * torch.finfo(dtype).eps).any()):
            raise _NotPositiveDefinite(  # (below rounding)
                name,
                said,
                f": their entries reach {largest:.3g}, so the damping is below their rounding error in {dtype}. "
                "If training is diverging, lower the learning rate; else increase damping.",
            )
        raise _NotPositiveDefinite(name, said)
    # Column-major out of LAPACK and exactly symmetric: its transpose is the row-major inverse, with no copy.
    return torch.cholesky_inverse(factor).mT.to(matrix.dtype)


class _NotPositiveDefinite(RuntimeError):
    """A damped factor that cannot be inverted (a ``RuntimeError`` to the user); ``why`` says what to do."""

    def __init__(self, name: str, said: str, why: str = "; increase damping.") -> None:
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
    values: Tensor, vectors: Tensor, damping: float | Tensor, name: str, dtype: torch.dtype, given: float | None = None
) -> Tensor:
    """:math:`Q\\,\\mathrm{diag}(1 / (\\lambda_i + \\text{damping}))\\,Q^\\top` in ``dtype``, row-major
    (``damping`` a number, or one per block; ``given`` the hyperparameter it was derived from).

    Raises:
        RuntimeError: If an eigenvalue plus the damping is not positive (damping 0 on a singular factor).
    """
    shifted = values + torch.as_tensor(damping, dtype=values.dtype, device=values.device)[..., None]
    if not bool((shifted > 0).all()):
        raise _NotPositiveDefinite(name, _said(damping, given))
    return ((vectors / shifted.unsqueeze(-2)) @ vectors.mT).to(dtype).contiguous()


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
