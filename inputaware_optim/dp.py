"""DP-SGD / DP-AdamW: per-sample gradient clipping with Gaussian noise (Abadi et al. 2016)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .adamw import InputAwareAdamW
from .base import InputAwareOptimizer, evaluate_closure
from .distributed import all_reduce_sum_
from .inputs import Call, Inputs
from .layers import GENERIC, Materialized, PerSample, _batch_of, layer_kind
from .sgd import InputAwareSGD

__all__ = ["DPSGD", "DPAdamW"]

_DOC = r"""

    Each step replaces the gradient of every parameter by its differentially private
    estimate (Abadi et al. 2016), then applies the stock update:

    .. math::
        \tilde g = \frac{1}{B}\Big(\sum_{i=1}^{B} g_i \min\big(1, \tfrac{C}{\lVert g_i\rVert}\big)
            + \mathcal N(0, \sigma^2 C^2 I)\Big)

    where :math:`g_i` is sample :math:`i`'s gradient of its own loss over *all* parameters of
    the optimizer, :math:`C` is ``max_grad_norm`` and :math:`\sigma` ``noise_multiplier``
    (with ``loss_reduction="sum"`` the division by :math:`B` is left out, as the loss was a sum).
    Per-sample gradients come from each captured call's inputs and output gradients:
    closed forms for ``nn.Linear`` and ``nn.Conv2d`` (the ghost norm, which never forms a
    batch × parameters tensor, including for sequence inputs), ``nn.Embedding``, and
    ``torch.func``'s ``vmap(grad)`` over the module's forward for any other layer.
    The noise comes from ``generator`` (default: a generator seeded from torch's global
    RNG at construction, so ``torch.manual_seed`` makes runs reproducible).

    Micro-batches (gradient accumulation) are separate samples of one step; each module
    must be called once per micro-batch. Under ``DistributedDataParallel`` each rank clips
    its own samples, the clipped sums are added across ranks, the noise is drawn once (on
    rank 0) and the result divided by the global batch, so every replica applies the same
    update. Layers that mix samples (``BatchNorm``) are refused.

    Privacy accounting (the :math:`(\varepsilon, \delta)` a run spends) is out of scope: use
    an accountant (for example Opacus's RDP accountant) with this ``noise_multiplier``, the
    sampling rate and the number of steps. The guarantee also assumes how batches are drawn
    (Poisson sampling in the analysis); fixed-size shuffled batches are the usual approximation.

    Args:
        model: The model.
        lr: Learning rate.
        max_grad_norm: :math:`C`, the L2 bound on each sample's gradient (> 0).
        noise_multiplier: :math:`\sigma` (>= 0; 0 turns the noise off).
        loss_reduction: ``"mean"`` (the loss averaged over the batch) or ``"sum"``.
        generator: The ``torch.Generator`` the noise is drawn from.
        params: Parameters or param groups of ``model`` (default: all that require grad).
    """


class _PerSampleClipping(InputAwareOptimizer):
    """The privatization shared by DPSGD and DPAdamW."""

    capture_grad_outputs = True

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-3,
        max_grad_norm: float = 1.0,
        noise_multiplier: float = 1.0,
        *,
        loss_reduction: str = "mean",
        generator: torch.Generator | None = None,
        params: Any = None,
        **kwargs: Any,
    ) -> None:
        _check_privacy(max_grad_norm, noise_multiplier, loss_reduction)
        self._privacy = (max_grad_norm, noise_multiplier, loss_reduction)
        self._generator = generator or _seeded_generator()
        super().__init__(model, params, lr=lr, **kwargs)

    def _check_param_groups(self) -> None:
        clip, sigma, reduction = self._privacy
        self._set_group_defaults(max_grad_norm=clip, noise_multiplier=sigma)
        for group in self.param_groups:
            _check_privacy(group["max_grad_norm"], group["noise_multiplier"], reduction)
            if (group["max_grad_norm"], group["noise_multiplier"]) != (clip, sigma):
                raise ValueError(
                    "max_grad_norm and noise_multiplier bound each sample's gradient over all parameters at "
                    "once, so every param group must use the same values"
                )
        self._refuse_sharded_parameters("per-sample gradients need each layer's whole parameters")
        for module in self._modules_to_capture(self._params()):
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                raise ValueError(
                    f"{type(self).__name__} cannot clip per-sample gradients through {type(module).__name__} "
                    "(it mixes the samples of a batch); use GroupNorm or LayerNorm instead"
                )

    @torch.no_grad()
    def step(self, closure: Any = None, inputs: Inputs | None = None) -> Any:
        """Replace every gradient by its clipped, noised estimate, then take the stock step."""
        loss = evaluate_closure(closure)
        assert inputs is not None
        private = self._private_gradients(inputs)
        for param, grad in private.items():
            assert param.grad is not None
            param.grad.copy_(grad)
        super().step(inputs=inputs)
        return loss

    def _private_gradients(self, inputs: Inputs) -> dict[Tensor, Tensor]:
        targets = [p for p in self._params() if p.grad is not None]
        if not targets:
            return {}
        group = self.param_groups[0]
        clip, sigma = float(group["max_grad_norm"]), float(group["noise_multiplier"])
        plan = self._plan(targets, inputs)
        # The captured gradient holds each sample's share of the loss; its own loss's gradient
        # is that share times the batch size when the loss was a mean.
        scale = float(plan.batch) if self._privacy[2] == "mean" else 1.0
        like = targets[0]
        squared = torch.zeros(plan.batch, dtype=torch.promote_types(like.dtype, torch.float32), device=like.device)
        for per_call in plan.per_sample.values():
            for window, per in zip(plan.windows, per_call, strict=True):
                squared[window] += per.sq_norms().to(squared)
        weights = scale * (clip / (scale * squared.sqrt() + 1e-6)).clamp(max=1.0)
        sums = {p: torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)) for p in targets}
        for owner, per_call in plan.per_sample.items():
            for window, per in zip(plan.windows, per_call, strict=True):
                for name, total in per.weighted_sum(weights[window]).items():
                    owned = owner._parameters[name] if isinstance(owner, nn.Module) else plan.shared[name]
                    assert owned is not None
                    sums[owned] += total.to(sums[owned])
        data_parallel = self.data_parallel_group
        if sigma > 0 and (data_parallel is None or torch.distributed.get_rank(data_parallel) == 0):
            for total in sums.values():  # drawn once over all ranks, so replicas stay identical
                noise = torch.randn(total.shape, generator=self._generator, device=self._generator.device)
                total += (noise * (sigma * clip)).to(total.device, total.dtype)
        count = torch.tensor(float(plan.batch), dtype=torch.float64)
        all_reduce_sum_([*sums.values(), count], data_parallel)
        divisor = float(count) if self._privacy[2] == "mean" else 1.0
        return {p: total / divisor for p, total in sums.items()}

    def _plan(self, targets: list[Tensor], inputs: Inputs) -> _Plan:
        """Each call's per-sample gradients, for every parameter; raises before any change."""
        capture = self.capture
        calls_of: dict[nn.Module, list[Call]] = {}
        single: dict[nn.Module, list[str]] = {}  # parameters only this module uses
        shared: dict[Tensor, list[tuple[nn.Module, str]]] = {}  # parameters several modules use
        for param in targets:
            owners = capture.owners(param)
            uncalled = [capture.name(m) for m in owners if inputs.get(m) is None]
            if not owners or uncalled:
                where = ", ".join(uncalled) or "a module the optimizer does not capture"
                raise RuntimeError(
                    f"{type(self).__name__} cannot compute per-sample gradients of a parameter of shape "
                    f"{tuple(param.shape)}: no forward call of {where} was captured this step (a weight used "
                    "without calling its module, as nn.MultiheadAttention does with out_proj, is not "
                    "supported). No parameter was changed"
                )
            uses = [(m, n) for m in owners for n, p in m._parameters.items() if p is param]
            for module, name in uses:
                calls_of.setdefault(module, inputs[module].calls)
                if len(uses) == 1:
                    single.setdefault(module, []).append(name)
            if len(uses) > 1:
                shared[param] = uses
        counts = {capture.name(m): len(calls) for m, calls in calls_of.items()}
        if len(set(counts.values())) != 1:
            raise RuntimeError(
                f"{type(self).__name__} needs each module called once per micro-batch, but the captured calls "
                f"per module differ ({counts}); a module called twice in one forward is not supported. "
                "No parameter was changed"
            )
        sizes = {capture.name(m): [_batch_of(c) for c in calls] for m, calls in calls_of.items()}
        if len({tuple(v) for v in sizes.values()}) != 1:
            raise RuntimeError(f"the captured calls disagree on the batch size of each micro-batch: {sizes}")
        plan = _Plan()
        batch_sizes = next(iter(sizes.values()))
        starts = [sum(batch_sizes[:k]) for k in range(len(batch_sizes))]
        plan.windows = [slice(start, start + size) for start, size in zip(starts, batch_sizes, strict=True)]
        plan.batch = sum(batch_sizes)
        for module, names in single.items():
            kind = layer_kind(module) or GENERIC
            plan.per_sample[module] = [kind.per_sample(module, call, names) for call in calls_of[module]]
        for index, (param, uses) in enumerate(shared.items()):  # a shared weight: add its owners' shares
            key = f"shared{index}"
            plan.shared[key] = param
            plan.per_sample[key] = [
                Materialized({key: _shared_grads(uses, calls_of, k)}) for k in range(len(batch_sizes))
            ]
        return plan


class _Plan:
    """Each call's per-sample gradients: under the module for the parameters only it uses, under a
    key of ``shared`` for a weight several modules use; and where each call's samples sit."""

    def __init__(self) -> None:
        self.per_sample: dict[nn.Module | str, list[PerSample]] = {}
        self.shared: dict[str, Tensor] = {}
        self.windows: list[slice] = []
        self.batch = 0


def _shared_grads(uses: list[tuple[nn.Module, str]], calls_of: dict[nn.Module, list[Call]], k: int) -> Tensor:
    """The per-sample gradient of a weight several modules use, summed over their call ``k``."""
    shares = [(layer_kind(m) or GENERIC).per_sample(m, calls_of[m][k], [n]).grads()[n] for m, n in uses]
    return torch.stack(shares).sum(0)


def _seeded_generator() -> torch.Generator:
    """A private generator seeded from torch's global RNG: reproducible under torch.manual_seed,
    and drawing noise from it leaves the global stream (dropout, data order) undisturbed."""
    return torch.Generator().manual_seed(int(torch.randint(0, 2**62, ()).item()))


def _check_privacy(max_grad_norm: float, noise_multiplier: float, loss_reduction: str) -> None:
    if not max_grad_norm > 0.0:
        raise ValueError(f"Invalid max_grad_norm: {max_grad_norm} (must be > 0)")
    if not noise_multiplier >= 0.0:
        raise ValueError(f"Invalid noise_multiplier: {noise_multiplier} (must be >= 0)")
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"Invalid loss_reduction: {loss_reduction!r} (choose 'mean' or 'sum')")


class DPSGD(_PerSampleClipping, InputAwareSGD):
    __doc__ = (
        "SGD with per-sample gradient clipping and Gaussian noise (DP-SGD).\n\n    ``DPSGD(model, lr=1e-3, "
        'max_grad_norm=1.0, noise_multiplier=1.0, *, loss_reduction="mean", generator=None, params=None, '
        "**sgd_kwargs)``" + _DOC
    )


class DPAdamW(_PerSampleClipping, InputAwareAdamW):
    __doc__ = (
        "AdamW with per-sample gradient clipping and Gaussian noise (DP-Adam with decoupled weight decay)."
        '\n\n    ``DPAdamW(model, lr=1e-3, max_grad_norm=1.0, noise_multiplier=1.0, *, loss_reduction="mean", '
        "generator=None, params=None, **adamw_kwargs)``" + _DOC
    )
