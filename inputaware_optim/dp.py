"""DP-SGD / DP-AdamW: per-sample gradient clipping with Gaussian noise (Abadi et al. 2016)."""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, NoReturn

import torch
from torch import Tensor, nn
from torch.linalg import vector_norm
from torch.profiler import record_function

from ._torch import scaler_handoff
from .accounting import PrivacyAccountant
from .adamw import InputAwareAdamW
from .base import InputAwareOptimizer, _step_arguments
from .capture import module_names, parameter_names, unwrap_model
from .clipping import ClippedSums, _unsupported, _zeros
from .distributed import (
    ParallelLayout,
    all_reduce_sum_,
    all_zero,
    local_tensor,
    reduce_scatter_like,
    shard_dim,
    sharded,
    tensor_parallel_style,
)
from .inputs import Inputs, user_stacklevel
from .layers import EmbeddingKind, LayerNormKind, LinearKind, bias_of, layer_kind, weight_of
from .reduction import Reduction
from .rule import Rule
from .sgd import InputAwareSGD

__all__ = ["DPSGD", "DPAdamW", "PerSampleClipping"]

_BATCH_NORMS: tuple[type[nn.Module], ...] = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_BATCH_NORMS += (nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d)


class PerSampleClipping(Rule):
    r"""DP-SGD's transform of the gradients: every gradient replaced by its differentially private estimate
    (``DPSGD``'s docstring has the rule and its arguments). It must come first in a chain (it clips the gradient
    as backward made it), and no rule after it may read the inputs (they are the batch's, not private).

    Hyperparameters in every param group (equal in all): ``max_grad_norm``, ``noise_multiplier``,
    ``expected_batch_size``, ``sample_rate``; under adaptive clipping also ``target_unclipped_quantile``,
    ``clipbound_learning_rate``, ``unclipped_num_std``, ``min_clipbound``, ``max_clipbound``.

    Attributes:
        accountant: The ``PrivacyAccountant`` of the steps taken.
    """

    private = True

    def __init__(
        self,
        max_grad_norm: float = 1.0,
        noise_multiplier: float = 1.0,
        *,
        loss_reduction: str = "mean",
        expected_batch_size: int | None = None,
        batch_dim: int = 0,
        sample_rate: float | None = None,
        generator: torch.Generator | None = None,
        target_unclipped_quantile: float | None = None,
        clipbound_learning_rate: float = 0.2,
        unclipped_num_std: float | None = None,
        min_clipbound: float = 0.0,
        max_clipbound: float = math.inf,
    ) -> None:
        _check_hyperparameters(loss_reduction, max_grad_norm, noise_multiplier, expected_batch_size, sample_rate)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"Invalid generator: {generator!r} (must be a torch.Generator, or None)")
        if batch_dim not in (0, 1) or isinstance(batch_dim, bool):
            raise ValueError(f"Invalid batch_dim: {batch_dim!r} (must be 0, or 1 for sequence-first inputs)")
        # The defaults of new param groups (each step reads the groups' own: a schedule may change them).
        self.defaults = {
            "max_grad_norm": max_grad_norm,
            "noise_multiplier": noise_multiplier,
            "expected_batch_size": expected_batch_size,
            "sample_rate": sample_rate,
        }
        self.adaptive = target_unclipped_quantile is not None
        if self.adaptive:  # (without it, the groups hold no key of it: a fixed clip)
            self.defaults |= {
                "target_unclipped_quantile": target_unclipped_quantile,
                "clipbound_learning_rate": clipbound_learning_rate,
                "unclipped_num_std": unclipped_num_std,
                "min_clipbound": min_clipbound,
                "max_clipbound": max_clipbound,
            }
            _check_adaptive({"max_grad_norm": max_grad_norm, "noise_multiplier": noise_multiplier, **self.defaults})
        self._whole_batch = _WHOLE_BATCH + (_ADAPTIVE if self.adaptive else ())
        self.loss_reduction = loss_reduction
        self.batch_dim = batch_dim
        self.accountant = PrivacyAccountant()
        # Seeded from the global RNG (reproducible under torch.manual_seed); drawing leaves its stream undisturbed.
        # Made in setup, on the parameters' device: the noise is drawn where it is added (a CUDA model's on the GPU).
        self._seed: int | None = None
        if generator is None:
            self._seed = int(torch.randint(0, 2**62, ()).item())
            generator = torch.Generator().manual_seed(self._seed)
        self._generator = generator
        self._clipped: ClippedSums | None = None
        self._released: float | None = None  # the noise multiplier of the step being taken, once it released
        self._next_clip: float | None = None  # adaptive clipping: the clip of the next step, once it released

    @property
    def reads(self) -> list[Reduction]:  # type: ignore[override]
        return [] if self._clipped is None else [self._clipped]

    @property
    def _name(self) -> str:
        return type(self.optimizer).__name__

    def state_dict(self) -> dict[str, Any]:
        """The noise generator's state (a resumed run never redraws the same noise, which would cancel when
        updates are differenced) and the privacy history."""
        return {"noise_generator": self._generator.get_state(), "privacy_history": self.accountant.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("noise_generator") is not None:
            self._generator.set_state(state["noise_generator"])
        if "privacy_history" in state:
            self.accountant.load_state_dict(state["privacy_history"])

    def setup(self, optimizer: Any) -> None:
        self.accountant.owner = type(optimizer).__name__
        device = next((local_tensor(p).device for p in optimizer._params()), self._generator.device)
        if self._seed is not None and self._generator.device != device:  # (the default: where the parameters are)
            self._generator = torch.Generator(device=device).manual_seed(self._seed)
        self._group_privacy()
        name, trained = type(optimizer).__name__, {p for p in optimizer._params() if p.requires_grad}
        layout = ParallelLayout(optimizer.model)
        if any(len(layout.data_dims(p)) > 1 for p in trained):  # HSDP: combined over one mesh dimension only
            raise NotImplementedError(
                f"{name} supports FSDP2 over a 1-D mesh only (got a 2-D mesh, as HSDP uses): its batch count and "
                "noise must be combined over every data-parallel rank"
            )
        names = module_names(optimizer.model)
        for module in optimizer._modules_to_capture(optimizer._params()):
            if isinstance(module, _BATCH_NORMS):
                raise ValueError(
                    f"{name} cannot clip per-sample gradients through {type(module).__name__} "
                    "(it mixes the samples of a batch); use GroupNorm or LayerNorm instead"
                )
            own = [p for p in module._parameters.values() if p is not None and p in trained]
            if any(layout.tensor_dims(p) for p in own):
                problem = _tensor_parallel_problem(layout, module, optimizer)
                if problem is not None:
                    raise NotImplementedError(
                        f"{name} cannot compute per-sample gradients of {names.get(module, '?')} under tensor "
                        f"parallelism: {problem}. Leave that module out of the tensor-parallel plan, or out of the "
                        "optimizer's params"
                    )
                continue
            kind = layer_kind(module)
            closed = kind is not None and kind.provides("per_sample")
            if not closed and any(sharded(p) for p in own):
                raise NotImplementedError(
                    f"{name} cannot compute per-sample gradients of {names.get(module, '?')} "
                    "under FSDP2: only layers with closed-form per-sample gradients "
                    "(nn.Linear, nn.Conv*d, nn.Embedding, ...) may be sharded; the generic vmap(grad) needs the whole "
                    "weights. Leave that module unsharded (apply fully_shard to the layers around it only)"
                )
        self._share_noise_generator(layout, trained)
        self._refuse_unsupported_layers()
        optimizer.capture.model_input_shapes(None)  # start keeping the model's input shapes (the batch check)
        optimizer.capture.follow_samples(self.batch_dim)  # and following the samples through each forward
        self._clipped = ClippedSums(self)

    def _share_noise_generator(self, layout: ParallelLayout, trained: set[Tensor]) -> None:
        """Under tensor parallelism, give every rank of the group the noise generator of its first rank: each draws
        the noise of a whole parameter (the same bits on each) and adds its part, so the noise is drawn once."""
        groups = {id(g): g for p in trained if (g := layout.tensor_group(p)) is not None}
        ranks = {tuple(torch.distributed.get_process_group_ranks(g)) for g in groups.values()}
        if len(ranks) > 1:
            raise NotImplementedError(
                f"{type(self.optimizer).__name__} supports one tensor-parallel group of ranks; the parameters are "
                f"split over {len(ranks)} ({', '.join(map(str, sorted(ranks)))})"
            )
        for group in list(groups.values())[:1]:
            state = [self._generator.get_state()]
            torch.distributed.broadcast_object_list(state, src=torch.distributed.get_global_rank(group, 0), group=group)
            self._generator.set_state(state[0])

    def _group_privacy(self) -> tuple[float, float]:
        """``(max_grad_norm, noise_multiplier)`` as the groups hold them now, checked equal in all groups."""
        groups = self.optimizer.param_groups
        first = groups[0]
        for index, group in enumerate(groups):
            self.check_group(group)  # (also read in the hooks, where the clipping happens)
            differ = [k for k in self._whole_batch if group[k] != first[k]]
            if differ:
                raise ValueError(
                    f"{', '.join(self._whole_batch)} describe every sample's gradient over all parameters at once, so "
                    "every param group must use the same values: param group 0 has "
                    f"{', '.join(f'{k}={first[k]}' for k in differ)}, param group {index} "
                    f"{', '.join(f'{k}={group[k]}' for k in differ)}. Change them in every group at once"
                )
        return float(first["max_grad_norm"]), float(first["noise_multiplier"])

    def check_group(self, group: dict[str, Any]) -> None:
        _check_hyperparameters(self.loss_reduction, *(group[k] for k in _WHOLE_BATCH))
        if self.adaptive:
            _check_adaptive(group)

    def _warn_outside(self, root: nn.Module) -> None:
        """Warn (once per set) of parameters of the model outside this optimizer that got a gradient: not private."""
        mine = set(self.optimizer._params())
        outside = frozenset(p for p in root.parameters() if p.requires_grad and p.grad is not None and p not in mine)
        if outside and outside != self.__dict__.get("_warned_outside"):
            names = [name for p, (name, _) in parameter_names(self.optimizer.model).items() if p in outside]
            warnings.warn(
                f"{self._name}: {len(names)} parameter(s) of the model got a gradient but are not among its "
                f"params ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}): backward computed it from "
                "the batch without clipping or noise, so the privacy guarantee covers nothing that reads or trains "
                "them (another optimizer, a logged gradient norm). Freeze them (requires_grad_(False)) or give them "
                "to this optimizer",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        self._warned_outside = outside

    def _refuse_unsupported_layers(self) -> None:
        optimizer = self.optimizer
        trained = {p for p in optimizer._params() if p.requires_grad}
        for module, qualified in module_names(optimizer.model).items():
            reason = _unsupported(module, trained)
            if reason is not None:
                where = f"{qualified or 'the model'} ({type(module).__name__})"
                raise ValueError(f"{self._name} cannot compute per-sample gradients of {where}: {reason}")

    def treatment(self, optimizer: Any, param: Tensor, module: nn.Module | None) -> tuple[str, str | None, bool]:
        if module is None:
            return "refused at step", "not a parameter of any module: its per-sample gradient is unknown", True
        kind = layer_kind(module)
        closed = kind is not None and kind.provides("per_sample")
        how = f"closed form for {type(module).__name__}" if closed else "torch.func vmap(grad) of its forward"
        return f"{type(optimizer).__name__}: per-sample clipping ({how})", None, False

    def update(self, optimizer: Any, inputs: Inputs) -> None:
        """Replace every gradient by its clipped, noised estimate."""
        self._released = None
        root = unwrap_model(optimizer.model)
        # requires_grad, or what a module registers (pruning and parametrizations move a weight), changed since
        checked = (
            frozenset(p for p in optimizer._params() if p.requires_grad),
            [(m, tuple(m._parameters)) for m in root.modules()],
        )
        if checked != self.__dict__.get("_checked_layout"):
            self._refuse_unsupported_layers()
            self._checked_layout = checked
        self._warn_outside(root)
        mixing = [optimizer.capture.name(m) for m in root.modules() if isinstance(m, _BATCH_NORMS) and m.training]
        if mixing:  # even without parameters, a batch norm in training mode mixes the samples
            raise RuntimeError(
                f"{self._name} cannot clip per-sample gradients: {', '.join(mixing)} normalizes over the "
                "batch in training mode, so each sample's gradient depends on the others. Use GroupNorm or "
                "LayerNorm, or put the batch norms in eval mode. No parameter was changed"
            )
        clip, sigma = self._group_privacy()
        self._next_clip = None
        private = self._private_gradients(inputs, clip, sigma)
        for param, grad in private.items():
            if param.grad is None:  # no sample reached it (a branch not taken, an expert no token chose): noise alone
                param.grad = torch.zeros_like(param)
            if param.grad.is_sparse:  # the noised estimate is dense: every row moves
                param.grad = grad.to(param.dtype)
            elif sharded(param.grad) and tuple(param.grad.placements) != tuple(param.placements):  # type: ignore[attr-defined]
                # (tensor parallelism leaves some gradients replicated or partial where the parameter is sharded or
                # replicated: ``grad`` is this rank's part, placed as the parameter is)
                from torch.distributed.tensor import DTensor

                mesh, placements = param.device_mesh, param.placements  # type: ignore[attr-defined]
                param.grad = DTensor.from_local(
                    grad.to(param.dtype), mesh, placements, shape=param.shape, stride=param.stride()
                )
            elif grad is not param.grad:  # not written in place; under FSDP2, ``grad`` is this rank's shard
                local_tensor(param.grad).copy_(grad)
        if private:  # a step with no gradient releases nothing
            self._released = sigma

    def advance(self, optimizer: Any) -> None:
        if self._released is not None:
            self.accountant.record(self._released, optimizer.param_groups[0]["sample_rate"])
        if self._released is not None and self._next_clip is not None:  # the clip follows the private quantile
            for group in optimizer.param_groups:
                group["max_grad_norm"] = self._next_clip
        self._released = self._next_clip = None

    def _gradient_noise(self, sigma: float) -> float:
        r"""The noise multiplier of the gradient: ``sigma`` itself, or under adaptive clipping Andrew et al.'s
        split (Theorem 1), :math:`\sigma_\Delta = (\sigma^{-2} - (2\sigma_b)^{-2})^{-1/2}`, so that the gradient and
        the count released together are the Gaussian mechanism of noise multiplier ``sigma`` (accounted)."""
        if not self.adaptive or sigma == 0:
            return sigma
        count_std = float(self.optimizer.param_groups[0]["unclipped_num_std"])
        return (sigma**-2 - (2 * count_std) ** -2) ** -0.5

    def _adapted_clip(self, within: Tensor, batch: float, clip: float) -> float:
        r"""The clip of the next step (Andrew et al. 2021): :math:`C \exp(-\eta_C (\tilde b - \gamma))`, within
        ``[min_clipbound, max_clipbound]``, where ``within`` is the noised :math:`\sum_i (b_i - 1/2)`
        (:math:`b_i = 1` if sample :math:`i`'s norm is at most :math:`C`; sensitivity 1/2) and
        :math:`\tilde b = within / m + 1/2`, :math:`m` the step's batch (``expected_batch_size`` where given)."""
        group = self.optimizer.param_groups[0]
        if batch == 0:  # no batch to take a fraction of (an empty one without expected_batch_size): it stays
            return clip
        fraction = float(within) / batch + 0.5
        step = -float(group["clipbound_learning_rate"]) * (fraction - float(group["target_unclipped_quantile"]))
        bounded = min(max(clip * math.exp(step), float(group["min_clipbound"])), float(group["max_clipbound"]))
        return max(bounded, math.ulp(0.0))  # (> 0: a clip that underflowed would be refused at the next step)

    def _centered_count(self, totals: dict[Tensor, Any], present: list[Tensor]) -> Tensor:
        r"""This rank's :math:`\sum_i (b_i - 1/2)` over the step's samples (float64, on the CPU)."""
        if not present:
            return torch.zeros((), dtype=torch.float64)
        entry = totals[max(present, key=lambda p: len(totals[p]["passes"]))]  # one that every pass reached
        within = torch.as_tensor(entry["within_clip"], dtype=torch.float64)
        return within - 0.5 * entry["samples"]

    def _count_noise(self) -> Tensor:
        r"""One draw of the count's noise, :math:`N(0, \sigma_b^2)`, from the generator (after the gradient's)."""
        std = float(self.optimizer.param_groups[0]["unclipped_num_std"] or 0.0)
        if std == 0:
            return torch.zeros((), dtype=torch.float64)
        noise = torch.randn((), generator=self._generator, device=self._generator.device)
        return noise.double().cpu() * std

    def _private_gradients(self, inputs: Inputs, clip: float, sigma: float) -> dict[Tensor, Tensor]:
        """The private gradients of every trained parameter, one no sample reached included (else which parameters
        moved would tell what the batch held); what the clipped sums cannot privatize is refused before any change."""
        trained = [p for p in self.optimizer._params() if p.requires_grad]
        targets = [p for p in trained if p.grad is not None]
        if not targets:  # no backward since the gradients were cleared: no step (as the stock optimizers)
            return {}
        totals = inputs.reduced(self._clipped)
        data_parallel = self.optimizer.data_parallel_group
        distributed = data_parallel is not None or any(sharded(p) for p in targets)
        if (
            not totals
            and all(float(g["lr"]) == 0 for g in self.optimizer.param_groups)
            and all_zero(p.grad for p in targets)
        ):
            # No data and no release (torch.distributed.checkpoint initializes an optimizer's state so): no call
            # in any gradient, every one zero (this rank's shard), at learning rate 0. The stock step on them is
            # data-independent and moves no parameter; nothing is accounted. (At another rate it is refused: a
            # skipped empty batch must still be noised.)
            return {}
        present = self._refuse_what_is_not_clipped(targets, totals, distributed)
        batch = self._step_batch(present, totals, clip)
        dtype = next((totals[p]["sum"].dtype for p in trained if p in totals), None)  # of the zeros of those unreached
        assert self._clipped is not None
        shape = self._clipped.sum_shape  # (under tensor parallelism, this rank's part)
        sums = {p: totals[p]["sum"] if p in totals else _zeros(p, dtype or p.dtype, shape(p)) for p in trained}
        return self._release(sums, totals, present, batch, clip, sigma, data_parallel if distributed else False)

    def _release(
        self,
        sums: dict[Tensor, Tensor],
        totals: dict[Tensor, Any],
        present: list[Tensor],
        batch: float,
        clip: float,
        sigma: float,
        data_parallel: Any,
    ) -> dict[Tensor, Tensor]:
        """The clipped sums noised and divided by the batch (over the ranks unless ``data_parallel`` is False);
        under adaptive clipping, the count noised too and the next clip taken from it."""
        std = self._gradient_noise(sigma) * clip
        count = self._centered_count(totals, present) if self.adaptive else None
        if data_parallel is not False:
            private, count, batch = self._private_gradients_over_ranks(sums, totals, batch, std, data_parallel, count)
        else:
            divisor = self._divisor(batch)
            with record_function("DP: noise"):
                private = {p: self._noised_into_grad(p, total, std, divisor) for p, total in sums.items()}
            count = None if count is None else count + self._count_noise()
        if count is not None:
            self._next_clip = self._adapted_clip(count, batch, clip)
        return private

    def _refuse_what_is_not_clipped(
        self, targets: list[Tensor], totals: dict[Tensor, Any], distributed: bool
    ) -> list[Tensor]:
        """The parameters whose gradient the clipped sums explain; refused: an error met in the hooks, a gradient
        no call explains (in one process), a forward split over backward passes, sums not adding up to it."""
        error = next((entry["error"] for entry in totals.values() if "error" in entry), None)
        if error is not None:
            self._raise_kept(*error)
        present = [p for p in targets if p in totals]
        if len(present) < len(targets) and not distributed:
            raise self._uncaptured([p for p in targets if p not in totals])
        self._refuse_split_forwards(totals)
        with record_function("DP: add-up check"):
            self._check_sums_add_up(present, totals, frozenset().union(*(totals[p]["dtypes"] for p in present)))
        return present

    def _step_batch(self, present: list[Tensor], totals: dict[Tensor, Any], clip: float) -> float:
        """The batch of this step; refuses a clip changed since backward, or accumulation not told its batch."""
        name = self._name
        expected = self.optimizer.param_groups[0]["expected_batch_size"]
        for key, setting, now, done in (
            ("clips", "max_grad_norm", clip, "clipped at"),
            ("expected", "expected_batch_size", expected, "scaled by"),
        ):
            used = set().union(*(totals[p][key] for p in present))
            if used - {now}:
                raise RuntimeError(
                    f"{name}: {setting} is {now} now, but the samples of this step were {done} "
                    f"{', '.join(map(str, sorted(used, key=str)))} when their backward pass ended. Change {setting} "
                    "between steps, before the next backward (a schedule's step() after optimizer.step()). No "
                    "parameter was changed"
                )
        first: dict[str, Any] = totals[present[0]] if present else {"samples": 0, "passes": {}}
        passes = len(first["passes"])
        if self.loss_reduction == "mean" and expected is None and passes > 1:
            raise RuntimeError(
                f"{name} got {passes} backward passes in one step (gradient accumulation) with "
                "loss_reduction='mean': to clip each sample's own gradient it must know the batch the loss is a "
                "mean over. Pass expected_batch_size=<samples per step> (each micro-batch's loss being its sum "
                "divided by that), or use loss_reduction='sum'. No parameter was changed"
            )
        return expected or first["samples"]

    def _divisor(self, batch: float) -> float:
        """What the noised sum is divided by: the batch the loss is a mean over (1 for a summed loss)."""
        if self.loss_reduction != "mean":
            return 1.0
        if batch == 0:
            raise RuntimeError(
                f"{self._name}: the batch of this step is empty (Poisson sampling draws empty batches), "
                "and with loss_reduction='mean' the noise is divided by the batch the loss is a mean over. Pass "
                "expected_batch_size=<sample_rate x dataset size> (as Opacus does): an empty batch then takes a "
                "noise-only step. No parameter was changed"
            )
        return float(batch)

    def _private_gradients_over_ranks(
        self,
        sums: dict[Tensor, Tensor],
        totals: dict[Tensor, Any],
        batch: float,
        std: float,
        data_parallel: Any,
        centered: Tensor | None,
    ) -> tuple[dict[Tensor, Tensor], Tensor | None, float]:
        """The clipped sums added over the ranks, the noise drawn once (on rank 0), divided by the batch; with the
        count of adaptive clipping (``centered``) added and noised likewise, and the batch of all ranks.
        Every rank adds the same list: zeros for a module its samples never reached (a branch, an expert)."""
        targets = list(sums)
        sums = {p: total.clone() if p in totals else total for p, total in sums.items()}  # (the capture keeps them)
        first = self._noised_once(sums, std, data_parallel)
        counts = [] if centered is None else [centered + self._count_noise() if first else centered.clone()]
        count = torch.tensor(float(batch), dtype=torch.float64)
        # The ranks that saw each (a parameter without a gradient has nothing to explain).
        captured = torch.tensor([float(p in totals or p.grad is None) for p in targets], dtype=torch.float64)
        all_reduce_sum_([*(s for p, s in sums.items() if not sharded(p)), count, captured, *counts], data_parallel)
        nowhere = [p for p, ranks in zip(targets, captured.tolist(), strict=True) if ranks == 0]
        if nowhere:  # on every rank alike, after the collective (no rank is left waiting)
            raise self._uncaptured(nowhere)
        assert self._clipped is not None
        layout = self._clipped.layout
        for param in [p for p in sums if layout.data_dims(p)]:  # FSDP2: this rank's shard of the sum (reduce-scatter)
            sums[param] = reduce_scatter_like(sums[param], param, layout.data_dims(param))
        divisor = self._divisor(float(count))  # on every rank alike: the count is all-reduced
        return {p: total / divisor for p, total in sums.items()}, (counts[0] if counts else None), float(count)

    def _noised_once(self, sums: dict[Tensor, Tensor], std: float, data_parallel: Any) -> bool:
        """Add the noise to ``sums`` on rank 0 only (drawn once over all ranks: replicas stay identical, as in one
        process); whether this is rank 0. Under tensor parallelism each rank of the group draws a parameter's
        whole noise (from the same generator state) and adds its part."""
        first = data_parallel is None or torch.distributed.get_rank(data_parallel) == 0
        if std > 0 and first:
            assert self._clipped is not None
            layout = self._clipped.layout
            for param, total in sums.items():
                noise = torch.randn(param.shape, generator=self._generator, device=self._generator.device)
                total.add_(layout.tensor_local(noise, param).to(total.device, total.dtype), alpha=std)
        return first

    def _refuse_split_forwards(self, totals: dict[Tensor, Any]) -> None:
        """Refuse a forward whose calls reached several backward passes: each pass clipped only its share."""
        passes = {token: seen for entry in totals.values() for token, seen in entry["passes"].items()}
        by_forward: dict[Any, list[tuple[str, ...]]] = {}
        for forwards, modules in passes.values():
            for forward in forwards:
                by_forward.setdefault(forward, []).append(modules)
        split = next((parts for parts in by_forward.values() if len(parts) > 1), None)
        if split is None:
            return
        shares = "; ".join(f"{', '.join(modules)} in pass {index + 1}" for index, modules in enumerate(split))
        raise RuntimeError(
            f"{self._name}: the calls of one forward reached {len(split)} separate backward passes "
            f"({shares}), each clipping its share of every sample's gradient on its own, which does not bound the "
            "whole. Reentrant activation checkpointing does this (checkpoint(..., use_reentrant=True)): checkpoint "
            "with use_reentrant=False (Hugging Face: model.gradient_checkpointing_enable("
            "gradient_checkpointing_kwargs={'use_reentrant': False})), which DP clips exactly. Two losses of one "
            "forward backpropagated separately do it too: sum them and call backward once. No parameter was changed"
        )

    def _raise_kept(self, error: Exception, where: str | None) -> NoReturn:
        """Raise an error the per-sample code met in a hook, of its type and from it, naming where."""
        if where is None:  # a refusal of DP's own (its message says what to do), or met outside a layer
            raise error
        message = (
            f"{self._name} could not compute the per-sample gradients of {where}: "
            f"{type(error).__name__}: {error}. No parameter was changed"
        )
        try:
            again = type(error)(message)
        except Exception:  # an exception type whose constructor takes other arguments: as it was raised
            raise error from None
        raise again from error

    def _uncaptured(self, params: list[Tensor]) -> RuntimeError:
        capture = self.optimizer.capture
        owners = list(dict.fromkeys(m for p in params for m in capture.owners(p)))
        where = ", ".join(capture.name(m) for m in owners) or "a module the optimizer does not capture"
        containers = [capture.name(m) for m in owners if isinstance(m, (nn.ParameterList, nn.ParameterDict))]
        hint = (
            f"; {', '.join(containers)} holds them but is never called: register them on the module whose forward "
            "uses them (that module is then differentiated per sample)"
            if containers
            else " (a weight used without calling its module, as nn.MultiheadAttention does with out_proj, is not "
            "supported)"
        )
        return RuntimeError(
            f"{self._name} cannot compute per-sample gradients of {len(params)} parameter(s) with a "
            f"gradient: no forward call of {where} is in that gradient{hint}. No parameter was changed"
        )

    def _noised_into_grad(self, param: Tensor, total: Tensor, std: float, divisor: float) -> Tensor:
        """``(total + N(0, std² I)) / divisor``, written into ``param.grad`` where it fits (dense, same
        dtype and device); ``total``, which the capture keeps, is left as it is."""
        grad, generator = param.grad, self._generator
        out = grad if grad is not None and _fits(grad, total) else torch.empty_like(total)
        if std == 0:
            return torch.div(total, divisor, out=out)
        if out.dtype == torch.get_default_dtype() and out.device == generator.device:
            out.normal_(0.0, std / divisor, generator=generator)  # randn's stream, scaled as it is drawn
        else:  # drawn in the default dtype on the generator's device, as the multi-process path does
            noise = torch.randn(total.shape, generator=generator, device=generator.device)
            torch.mul(noise.to(total.device, total.dtype), std / divisor, out=out)
        return out.add_(total, alpha=1.0 / divisor)

    def _check_sums_add_up(self, targets: list[Tensor], totals: dict[Tensor, Any], dtypes: frozenset[Any]) -> None:
        """Refuse a gradient the per-sample gradients do not add up to: part of it could not be clipped.
        Gaps are measured against the whole gradient's norm (a bias a normalization cancels is zero up to rounding)."""
        checked = [p for p in targets if totals[p]["unclipped"] is not None and p.grad is not None]
        assert self._clipped is not None
        probes = self._clipped.probes
        compared = {p: (totals[p]["unclipped"], probes.project(p, p.grad)) for p in checked}  # type: ignore[arg-type]
        exact = all(d == torch.float64 for d in dtypes) and all(g.dtype == torch.float64 for _, g in compared.values())
        pairs = [  # per parameter: the gap's norm and the gradient's, read at once below
            torch.stack([vector_norm(plain.to(grad.dtype) - grad), vector_norm(grad)]).double()
            for plain, grad in compared.values()
        ]
        one_device = len({p.device for p in pairs}) == 1  # else one read per parameter
        values = torch.stack(pairs).tolist() if one_device else [pair.tolist() for pair in pairs]
        # Under autocast autograd rounds each weight gradient to bfloat16 (or float16) while the
        # per-sample sums add in float32: the gap is then up to about half an eps of the lowest dtype
        # the backward ran in (0.1-0.2% measured in bfloat16; a tied weight: 5-50%).
        tolerance = 1e-9 if exact else max([1e-3, *(torch.finfo(d).eps for d in dtypes)])
        whole = math.sqrt(sum(norm * norm for _, norm in values))
        wrong = {p: gap for p, (gap, _) in zip(compared, values, strict=True) if not gap <= tolerance * whole + 1e-30}
        if wrong:
            self._refuse_unexplained(compared, wrong, whole, tolerance, torch.float16 in dtypes)

    def _refuse_unexplained(
        self, compared: dict[Tensor, Any], wrong: dict[Tensor, float], whole: float, tolerance: float, float16: bool
    ) -> NoReturn:
        """Raise the refusal of a gradient its per-sample gradients do not add up to, naming the likely cause."""
        name = self._name
        # The gradient a factor c (neither 1 nor 0) times the per-sample sums, as after a gradient clip?
        pairs = [(plain.double(), grad.double()) for plain, grad in compared.values()]
        square = sum(float(plain.pow(2).sum()) for plain, _ in pairs)
        factor = sum(float((plain * grad).sum()) for plain, grad in pairs) / square if square != 0.0 else 1.0
        residual = math.sqrt(sum(float((grad - factor * plain).pow(2).sum()) for plain, grad in pairs))
        whole_grad = math.sqrt(sum(float(grad.pow(2).sum()) for _, grad in pairs))
        if not (abs(factor - 1.0) <= tolerance or factor <= 0.0 or residual > tolerance * whole_grad):
            raise RuntimeError(
                f"{name}: the gradient backward computed is the sum of the per-sample gradients times {factor:.4g}, "
                "for every parameter alike: it was rescaled after backward, as a gradient clip does. Trainers do it by "
                "a setting: Lightning's Trainer(gradient_clip_val=...) (leave it None), Hugging Face's "
                "TrainingArguments(max_grad_norm=1.0, its default: pass max_grad_norm=0), Accelerate's "
                f"accelerator.clip_grad_norm_ and torch.nn.utils.clip_grad_norm_ (leave the call out). {name} clips "
                "each sample's gradient itself and must see the gradient as backward made it. No parameter was changed"
            )
        capture = self.optimizer.capture
        owners = ", ".join(dict.fromkeys(capture.name(m) for p in wrong for m in capture.owners(p)))
        worst = max(wrong.values()) / max(whole, 1e-30)
        hint = (
            "; under float16 autocast, a loss scale too small for these gradients, which backward rounded "
            "in float16's subnormal range (a GradScaler with a larger init_scale, or bfloat16)"
        )
        raise RuntimeError(
            f"{name}: the per-sample gradients of {owners or 'a module'} do not add up to the gradient backward "
            f"computed (off by {worst:.1%} of the gradient's norm), so part of it cannot be clipped per sample. "
            "Typical causes: the weight is also used without calling its module (a tied head written "
            "F.linear(h, embed.weight): call the module instead), the gradient was changed after backward "
            "(clip_grad_norm_, Lightning's gradient_clip_val, Hugging Face's max_grad_norm, manual edits: leave "
            "it as backward made it), a gradient still holding the last step's (call zero_grad() before the first "
            "backward of each step), or a gradient penalty (torch.autograd.grad(..., create_graph=True) then "
            f"backward), whose double-backward terms mix samples{hint if float16 else ''}. No parameter was changed"
        )


def _tensor_parallel_problem(layout: ParallelLayout, module: nn.Module, optimizer: Any) -> str | None:
    """Why DP cannot form this rank's part of the per-sample gradients of ``module``, whose parameters tensor
    parallelism splits or replicates (``None``: it can)."""
    params = [p for p in module._parameters.values() if p is not None]
    if any(len(layout.tensor_dims(p)) > 1 for p in params):
        return "its parameters are split over more than one tensor-parallel mesh dimension"
    if any(len(optimizer.capture.owners(p)) > 1 for p in params):
        return "its weight is used by several modules (a tied weight)"
    kind = layer_kind(module)
    placements = [layout.tensor_placements(p)[0] for p in params if layout.tensor_dims(p)]
    if type(kind) is LinearKind:
        style = tensor_parallel_style(layout, weight_of(module), bias_of(module))
        if style in ("columns", "rows", "replicated"):
            return None
        return f"its weight and bias are {style}"
    if type(kind) is EmbeddingKind and shard_dim(placements[0]) in (0, 1, None):
        return None  # (its rows, the vocabulary, or its features)
    if type(kind) is LayerNormKind and all(p.is_replicate() for p in placements):
        return None  # (SequenceParallel: each rank's positions' share of a sample's gradient, summed over the ranks)
    return (
        "only nn.Linear, nn.Embedding and nn.LayerNorm (replicated, as SequenceParallel leaves it) split by tensor "
        f"parallelism have per-sample gradients here; this {type(module).__name__} is placed as "
        f"{', '.join(map(str, placements))}"
    )


def _fits(grad: Tensor, total: Tensor) -> bool:
    """Whether ``total``'s noised estimate can be written into ``grad`` itself (dense, alike, contiguous)."""
    alike = grad.dtype == total.dtype and grad.device == total.device and grad.shape == total.shape
    return not grad.is_sparse and alike and grad.is_contiguous()


_WHOLE_BATCH = ("max_grad_norm", "noise_multiplier", "expected_batch_size", "sample_rate")
_ADAPTIVE = (
    "target_unclipped_quantile",
    "clipbound_learning_rate",
    "unclipped_num_std",
    "min_clipbound",
    "max_clipbound",
)


def _check_adaptive(group: dict[str, Any]) -> None:
    """Check adaptive clipping's hyperparameters in ``group`` (and its noise split, against ``noise_multiplier``)."""

    def real(value: Any) -> bool:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)

    quantile, rate, std = (
        group["target_unclipped_quantile"],
        group["clipbound_learning_rate"],
        group["unclipped_num_std"],
    )
    low, high, sigma = group["min_clipbound"], group["max_clipbound"], group["noise_multiplier"]
    if not (real(quantile) and 0.0 <= quantile <= 1.0):
        raise ValueError(f"Invalid target_unclipped_quantile: {quantile!r} (must be in [0, 1])")
    if not (real(rate) and 0.0 <= rate < math.inf):
        raise ValueError(f"Invalid clipbound_learning_rate: {rate!r} (must be finite and >= 0)")
    if not (real(low) and real(high) and 0.0 <= low < high):
        raise ValueError(
            f"Invalid min_clipbound, max_clipbound: {low!r}, {high!r} (need 0 <= min_clipbound < max_clipbound)"
        )
    if std is not None and not (real(std) and 0.0 <= std < math.inf):
        raise ValueError(f"Invalid unclipped_num_std: {std!r} (must be None or finite and >= 0)")
    if sigma > 0 and not (std is not None and sigma < 2 * std):
        raise ValueError(
            f"Invalid unclipped_num_std: {std!r} with noise_multiplier={sigma}: adaptive clipping releases a noised "
            "count of the samples within the clip beside the gradient, and the two together are the Gaussian "
            "mechanism of noise_multiplier (accounted) only if noise_multiplier < 2 * unclipped_num_std (Andrew et "
            "al. 2021, Theorem 1). Pass unclipped_num_std (the standard deviation of the count's noise; the paper "
            "suggests expected_batch_size / 20)"
        )


def _check_hyperparameters(
    loss_reduction: str, max_grad_norm: float, noise_multiplier: float, expected_batch_size: Any, sample_rate: Any
) -> None:
    for name, value in (("max_grad_norm", max_grad_norm), ("noise_multiplier", noise_multiplier)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f"Invalid {name}: {value!r} (must be a number: DP-SGD clips every sample's gradient to "
                "max_grad_norm and adds noise_multiplier * max_grad_norm; there is no DP without both)"
            )
    if not 0.0 < max_grad_norm < math.inf:
        raise ValueError(f"Invalid max_grad_norm: {max_grad_norm} (must be finite and > 0)")
    if not 0.0 <= noise_multiplier < math.inf:
        raise ValueError(f"Invalid noise_multiplier: {noise_multiplier} (must be finite and >= 0)")
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"Invalid loss_reduction: {loss_reduction!r} (choose 'mean' or 'sum')")
    if expected_batch_size is not None and (
        isinstance(expected_batch_size, bool) or not isinstance(expected_batch_size, int) or expected_batch_size < 1
    ):
        raise ValueError(f"Invalid expected_batch_size: {expected_batch_size!r} (must be None or an integer >= 1)")
    real = isinstance(sample_rate, numbers.Real) and not isinstance(sample_rate, bool)
    if sample_rate is not None and not (real and 0.0 < float(sample_rate) <= 1.0):
        raise ValueError(f"Invalid sample_rate: {sample_rate!r} (must be None or in (0, 1])")


class _PrivateOptimizer(InputAwareOptimizer):
    """What DPSGD and DPAdamW share: a ``PerSampleClipping`` rule in front of the stock update."""

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-3,
        max_grad_norm: float = 1.0,
        noise_multiplier: float = 1.0,
        *,
        loss_reduction: str = "mean",
        expected_batch_size: int | None = None,
        batch_dim: int = 0,
        sample_rate: float | None = None,
        generator: torch.Generator | None = None,
        target_unclipped_quantile: float | None = None,
        clipbound_learning_rate: float = 0.2,
        unclipped_num_std: float | None = None,
        min_clipbound: float = 0.0,
        max_clipbound: float = math.inf,
        params: Any = None,
        **kwargs: Any,
    ) -> None:
        rule = PerSampleClipping(
            max_grad_norm,
            noise_multiplier,
            loss_reduction=loss_reduction,
            expected_batch_size=expected_batch_size,
            batch_dim=batch_dim,
            sample_rate=sample_rate,
            generator=generator,
            target_unclipped_quantile=target_unclipped_quantile,
            clipbound_learning_rate=clipbound_learning_rate,
            unclipped_num_std=unclipped_num_std,
            min_clipbound=min_clipbound,
            max_clipbound=max_clipbound,
        )
        more = kwargs.pop("rules", ())
        more = [more] if isinstance(more, Rule) else list(more)
        super().__init__(model, params, lr=lr, rules=[rule, *more], **kwargs)
        self._skip_signals: list[bool] = []  # Opacus's protocol (signal_skip_step): one per coming step()
        self._virtual = False  # the last step() was virtual: zero_grad() keeps what it accumulated

    # -- virtual steps (Opacus's BatchMemoryManager) ----------------------------------------------------

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Make the coming ``step()`` virtual (``do_skip``) or real: Opacus's protocol, by which its
        ``BatchMemoryManager`` splits each logical batch into physical batches of at most
        ``max_physical_batch_size``, signalling before each one (in order, a queue, as Opacus keeps it).

        A virtual step changes nothing (no clipping is undone, no noise drawn, no step accounted; a closure is
        run and its loss returned), and the ``zero_grad()`` after it keeps the gradients and what DP captured of
        them, so the next backward adds to them: the real step that ends the logical batch clips every sample of
        it (each was clipped as its backward ended) and draws the noise once, as one step on the whole logical
        batch would (tested equal, noise included). Under ``loss_reduction="mean"`` each physical batch's loss is
        its sum divided by ``expected_batch_size``, which the several backward passes require."""
        self._skip_signals.append(bool(do_skip))

    def _run_step(self, step: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._skip_signals and self._skip_signals.pop(0):
            return self._virtual_step(args, dict(kwargs))
        try:
            return super()._run_step(step, args, kwargs)
        finally:
            self._virtual = False  # (after the step: a closure's zero_grad() still kept the logical batch)

    def _virtual_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        closure, _ = _step_arguments(args, kwargs)
        if scaler_handoff(self)[0] is not None:
            raise RuntimeError(
                f"{type(self).__name__}: a virtual step (signal_skip_step, Opacus's BatchMemoryManager) under "
                "GradScaler would add physical batches scaled by different loss scales; train in bfloat16 (no "
                "GradScaler) or float32 to use virtual steps. No parameter was changed"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._virtual = True
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients and drop the captured calls, as every input-aware optimizer does; after a virtual
        step (``signal_skip_step``) nothing: the logical batch goes on."""
        if not self._virtual:
            super().zero_grad(set_to_none)

    # -- privacy accounting ------------------------------------------------------------------------------

    @property
    def privacy_history(self) -> list[tuple[float, float | None, int]]:
        """``(noise_multiplier, sample_rate, steps)`` per run of steps at the same pair, as Opacus keeps it."""
        return list(self._clipping.accountant.history)

    def epsilon(self, delta: float, accountant: str = "prv") -> float:
        r"""The :math:`\varepsilon` spent so far for ``delta``, by Opacus's accountant over ``privacy_history``.

        Args:
            delta: The target :math:`\delta` (in (0, 1)).
            accountant: Opacus's ``"prv"`` (its default), ``"rdp"`` or ``"gdp"`` (one noise multiplier only).

        Raises:
            ValueError: If no ``sample_rate`` was given, or ``"gdp"`` is asked of a changing noise.
            ImportError: If ``opacus`` is not installed.
        """
        return self._clipping.accountant.epsilon(delta, accountant, self.param_groups[0]["sample_rate"])

    # The noise multiplier for a privacy budget, from the class: ``DPSGD.noise_multiplier_for(epsilon=..., ...)``.
    noise_multiplier_for = staticmethod(PrivacyAccountant.noise_multiplier_for)

    @property
    def _clipping(self) -> PerSampleClipping:
        return self.rules[0]  # type: ignore[return-value]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, the noise generator and privacy history with it (also where earlier versions
        kept them: the top level, or the first param group; 0.2's step count taken to be at the loaded noise
        multiplier)."""
        own = ("noise_generator", "privacy_steps", "privacy_history")
        groups = [{k: v for k, v in g.items() if k not in own} for g in state_dict.get("param_groups", ())]
        saved = {k: v for k, v in [*state_dict.items(), *state_dict.get("param_groups", [{}])[0].items()] if k in own}
        if saved and groups:  # an earlier layout: the rule's state where the composition keeps it now
            if "privacy_steps" in saved and "privacy_history" not in saved:
                group = groups[0]
                sigma = float(group.get("noise_multiplier", self.param_groups[0]["noise_multiplier"]))
                rate = group.get("sample_rate", self.param_groups[0].get("sample_rate"))
                saved["privacy_history"] = (
                    [(sigma, rate, int(saved["privacy_steps"]))] if saved["privacy_steps"] else []
                )
            rules = dict(groups[0].get("rules", {}))
            rules["0"] = {k: saved[k] for k in ("noise_generator", "privacy_history") if k in saved}
            groups[0] = {**groups[0], "rules": rules}
        super().load_state_dict({k: v for k, v in state_dict.items() if k not in own} | {"param_groups": groups})


class DPSGD(_PrivateOptimizer, InputAwareSGD):
    r"""SGD with per-sample gradient clipping and Gaussian noise (DP-SGD).

    Each step replaces every parameter's gradient by its differentially private estimate (Abadi et al. 2016),
    then applies the stock update (SGD's keywords are passed on, ``**sgd_kwargs``):

    .. math::
        \tilde g = \frac{1}{B}\Big(\sum_{i=1}^{B} g_i \min\big(1, \tfrac{C}{\lVert g_i\rVert}\big)
            + \mathcal N(0, \sigma^2 C^2 I)\Big)

    where :math:`g_i` is sample :math:`i`'s gradient over *all* parameters of the optimizer (with
    ``loss_reduction="sum"`` the division by :math:`B` is left out). Per-sample gradients come from each captured
    call's inputs and output gradients within the one backward pass (closed forms for the common layers,
    ``torch.func``'s ``vmap(grad)`` for others), and every step checks that they add up to the gradient backward
    computed. ``max_grad_norm`` and ``noise_multiplier`` are read from the param groups, equal in all (a schedule
    may change them between steps). What is refused, gradient accumulation, DDP and FSDP2, and the accounting: see
    the DP guide (``docs/dp.md``). ``noise_multiplier_for`` finds the noise multiplier for a privacy budget;
    ``signal_skip_step`` makes Opacus's ``BatchMemoryManager`` split logical batches into physical ones.

    Adaptive clipping (Andrew et al. 2021), with ``target_unclipped_quantile`` :math:`\gamma`: after each step the
    clip follows a private quantile of the per-sample norms,

    .. math::
        \tilde b = \frac{1}{m}\Big(\sum_{i=1}^{B} \big(b_i - \tfrac12\big) + \mathcal N(0, \sigma_b^2)\Big) + \tfrac12,
        \qquad C \leftarrow C \exp\big(-\eta_C (\tilde b - \gamma)\big)

    (:math:`b_i = 1` if :math:`\lVert g_i\rVert \le C`; :math:`m` the step's batch, ``expected_batch_size`` where
    given; :math:`C` kept in ``[min_clipbound, max_clipbound]`` and written into ``max_grad_norm``), and the gradient
    is noised at :math:`\sigma_\Delta = (\sigma^{-2} - (2\sigma_b)^{-2})^{-1/2}`, so that gradient and count
    together are the Gaussian mechanism of noise multiplier :math:`\sigma`, which is accounted.

    Args:
        model: The model.
        lr: Learning rate.
        max_grad_norm: :math:`C`, the L2 bound on each sample's gradient (> 0).
        noise_multiplier: :math:`\sigma` (>= 0; 0 turns the noise off).
        loss_reduction: ``"mean"`` (the loss averaged over the batch) or ``"sum"``.
        expected_batch_size: The samples per step the loss is a mean over, and the noised sum's
            divisor (needed under gradient accumulation; under Poisson sampling, rate × dataset size).
            Under data parallelism it is per rank, the samples one rank's step averages over: 2 ranks of 4
            samples take ``expected_batch_size=4``, not 8 (the step divides by the sum over the ranks).
        batch_dim: The dimension of every layer's input that holds the samples (0, or 1 for ``(T, B, ...)``).
        sample_rate: Each sample's probability of being in a batch, for ``epsilon`` (or None).
        generator: The ``torch.Generator`` the noise is drawn from (default: one on the parameters' device,
            seeded from torch's global RNG at construction, so ``torch.manual_seed`` makes runs reproducible).
        target_unclipped_quantile: :math:`\gamma`, the fraction of samples the clip should leave unclipped
            (in [0, 1]); ``None`` (default): a fixed clip, no adaptive clipping.
        clipbound_learning_rate: :math:`\eta_C` (>= 0; the paper's 0.2).
        unclipped_num_std: :math:`\sigma_b`, the standard deviation of the count's noise (in samples); needed
            when ``noise_multiplier > 0``, and then more than ``noise_multiplier / 2`` (the paper: ``m / 20``).
        min_clipbound: The smallest clip adaptive clipping may set (>= 0).
        max_clipbound: The largest (default: unbounded).
        params: Parameters or param groups of ``model`` (default: all that require grad).
    """


class DPAdamW(_PrivateOptimizer, InputAwareAdamW):
    """AdamW with per-sample gradient clipping and Gaussian noise (DP-Adam with decoupled weight decay).

    ``DPAdamW(model, lr=1e-3, max_grad_norm=1.0, noise_multiplier=1.0, *, ...)``: the arguments, the private
    gradient and its guarantees are `DPSGD`'s; the update is ``torch.optim.AdamW``'s, its keywords passed on."""
