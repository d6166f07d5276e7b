"""GradScaler's handoff to an input-aware optimizer: it unscales and skips by itself (``GradScaler`` then steps
it even on inf/NaN), so that a skipped step also drops its captures and a rule sees unscaled gradients."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from ._torch import drop_scaler_handoff, grad_scaler_unscale_, hide_scaler_handoff, in_place_values, scaler_handoff

__all__ = ["ScalerHandoff"]


class ScalerHandoff:
    """One optimizer's side of ``GradScaler.step``: ``begin`` before the step (unscale, or say to skip), ``undo``
    after a step that raised (the gradients scaled back as GradScaler left them), ``end`` after every step."""

    def __init__(self) -> None:
        self.unscaled_by: Tensor | None = None

    def begin(self, optimizer: Any) -> bool:
        """Unscale for a GradScaler-driven step; True if the step must be skipped (inf/NaN)."""
        grad_scale, found_inf = scaler_handoff(optimizer)
        if found_inf is None:
            return False
        capture = optimizer.capture
        capture.refresh()  # before the unscaling below changes the gradients in place
        if not optimizer._reads_inputs() and any(group.get("fused") for group in optimizer.param_groups):
            return False  # the stock fused kernel unscales and skips by itself
        if found_inf.item():
            capture.clear()  # GradScaler skips the step: so do the captures
            return True
        if capture.grad_scaler is None and (
            (capture.keep_calls and capture.grad_outputs) or any(r.grad_outputs for r in capture.reductions)
        ):
            raise RuntimeError(
                f"{type(optimizer).__name__} reads the output gradients of its layers, and under a GradScaler they "
                "carry the loss scale. Construct it with grad_scaler=scaler (the GradScaler you step with) so "
                "that they are unscaled where they are read. No parameter was changed"
            )
        if grad_scale is not None:
            _unscale(_grads(optimizer), grad_scale)
            self.unscaled_by = grad_scale
            capture._gradients_rescaled()
        hide_scaler_handoff(optimizer)  # from the stock kernels (GradScaler deletes it after the step)
        return False

    @torch.no_grad()
    def undo(self, optimizer: Any) -> None:
        """After a step that raised: scale the gradients back and clear what GradScaler set."""
        scale = self.unscaled_by
        if scale is not None:
            for grad in _grads(optimizer):
                grad.mul_(scale.to(grad.device, grad.dtype))
            optimizer.capture._gradients_rescaled()
        drop_scaler_handoff(optimizer)

    def end(self) -> None:
        self.unscaled_by = None


def _grads(optimizer: Any) -> list[Tensor]:
    return [in_place_values(p.grad) for p in optimizer._params() if p.grad is not None]


@torch.no_grad()
def _unscale(grads: list[Tensor], grad_scale: Tensor) -> None:
    # GradScaler.unscale_'s kernel and grouping, so the result is bitwise the stock path's.
    inv_scale = grad_scale.double().reciprocal().float()
    grouped: defaultdict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for grad in grads:
        if grad.dtype == torch.float16:
            raise ValueError("Attempting to unscale FP16 gradients.")
        grouped[(grad.device, grad.dtype)].append(grad)
    for (device, _), group in grouped.items():
        grad_scaler_unscale_(group, torch.zeros(1, device=device), inv_scale.to(device))
