"""DP-SGD's reduction (``ClippedSums``): once a backward pass is complete, the calls of each forward of the model
are one set of samples, each sample's gradient over every parameter clipped, and what is kept is the clipped sum
per parameter (and, for the check that they add up to the gradient, the unclipped one, projected)."""

from __future__ import annotations

import itertools
import math
import sys
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.profiler import record_function

from . import layers
from ._torch import tree_flatten
from .distributed import ParallelLayout, all_reduce_sum_, local_call, local_tensor, shard_dim
from .inputs import Call
from .layers import EmbeddingKind, LinearKind, layer_kind
from .per_sample import (
    BlockRows,
    IndexedRows,
    Materialized,
    MatrixRows,
    PerSample,
    _functional_per_sample_grads,
    merged_rows,
)
from .provenance import BROADCAST, UNKNOWN
from .reduction import Reduction, add_statistics

if TYPE_CHECKING:
    from .dp import PerSampleClipping

__all__ = ["ClippedSums"]

_Calls = dict[nn.Module, list[Call]]  # one forward's calls, by module
# Clipped and unclipped sums, by parameter, and how many samples' norms were at most the clip (adaptive clipping).
_Sums = tuple[dict[Tensor, Tensor], dict[Tensor, Tensor], Any]


class ClippedSums(Reduction):
    """DP's reduction: when a backward pass is complete, the calls of each forward of the model are
    one set of samples, each clipped over every parameter; what is kept is the clipped sum per parameter."""

    grad_outputs = True
    keeps_inputs = True  # under activation checkpointing, the inputs of the re-run in backward

    def __init__(self, rule: PerSampleClipping) -> None:
        self.owner = weakref.ref(rule)  # the reduction lives in the capture, which the optimizer (and rule) owns
        # The add-up check: in one process only (under data parallelism the gradient is averaged already).
        self.verify = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        self.probes = _Probes()
        self.passes = itertools.count()  # a token per backward pass
        self.reduction = rule.loss_reduction
        optimizer = rule.optimizer
        capture = self.capture = optimizer.capture
        self.batch_dim, self.name = rule.batch_dim, capture.name
        trained = set(optimizer._params())  # all of the groups': which require grad is read when each pass ends
        self.names: dict[nn.Module, list[str]] = {}  # parameters only this module owns
        self.shared: dict[Tensor, list[tuple[nn.Module, str]]] = {}  # parameters several modules own
        for module in capture.modules:
            for name, param in module._parameters.items():
                if param is None or param not in trained:
                    continue
                own = capture.owners(param)  # a parent among them uses it through the child: left out
                innermost = [m for m in own if not any(o is not m and any(o is d for d in m.modules()) for o in own)]
                owners = [(m, n) for m in innermost for n, q in m._parameters.items() if q is param]
                if module not in [m for m, _ in owners]:
                    continue  # a parent that reaches it only through a child owner (BERT's MLM bias)
                if len(owners) == 1:
                    self.names.setdefault(module, []).append(name)
                else:
                    self.shared[param] = owners
        self.modules = {*self.names, *(m for uses in self.shared.values() for m, _ in uses)}
        # Tensor parallelism: each rank computes its part of every sample's gradient of a parameter split over the
        # ranks (its shape in ``parts``), whose squared norms add up over the group (``split``); a replicated one's
        # is counted once.
        self.layout = ParallelLayout(optimizer.model)
        self.parts, self.split = _tensor_parallel_parts(self.layout, trained)

    def sum_shape(self, param: Tensor) -> torch.Size:
        """The shape of ``param``'s clipped sum on this rank: its part under tensor parallelism, else its own."""
        return self.parts.get(param, param.shape)

    def wants(self, module: nn.Module) -> bool:
        return module in self.modules

    def forward(self, call: Call) -> Any:
        return call  # its inputs, until its output gradient arrives

    def backward(self, call: Call, kept: Any) -> Any:
        return Call(call.module, kept.args, kept.kwargs, call._grad_slot, call.forward)

    def _trained_names(self, module: nn.Module) -> list[str]:
        """``module``'s own parameters that require grad now (a layer frozen since enters no norm)."""
        return [n for n in self.names.get(module, ()) if module._parameters[n].requires_grad]  # type: ignore[union-attr]

    def finish(self, entries: Sequence[tuple[Call, Any]]) -> dict[Tensor, Any]:
        """The clipped sums of one backward pass; an error is kept in them (``"error"``) for the step to raise."""
        try:
            return self._finish(entries)
        except Exception as error:
            where, cause = error.args if isinstance(error, _Located) else (None, error)
            reached = {c.module for _, c in entries}
            params = [m._parameters[n] for m in reached for n in self.names.get(m, ())]
            params += [p for p, uses in self.shared.items() if any(m in reached for m, _ in uses)]
            return {p: {"error": (cause, where)} for p in params if p is not None}

    def _finish(self, entries: Sequence[tuple[Call, Any]]) -> dict[Tensor, Any]:
        by_forward = self._by_forward(entries)
        if not by_forward:
            return {}
        samples = {forward: self._samples(forward, calls) for forward, calls in by_forward.items()}
        owner = self.owner()
        assert owner is not None
        clip = owner._group_privacy()[0]  # read now: a schedule may change it (as expected_batch_size)
        expected = owner.optimizer.param_groups[0]["expected_batch_size"]
        scale = float(expected or sum(samples.values())) if self.reduction == "mean" else 1.0
        out: dict[Tensor, Any] = {}
        unclipped: dict[Tensor, Any] = {}
        within: Any = 0.0
        for forward, calls in by_forward.items():  # an empty batch (Poisson sampling): zero sums
            sums, plain, count = self._clipped_sums(calls, scale, clip) if samples[forward] else self._empty_sums(calls)
            _add_into(out, sums)
            _add_into(unclipped, plain)
            within = within + count
        # This pass, by a token of its own: which forwards it holds, through which modules.
        modules = tuple(dict.fromkeys(self.name(m) for calls in by_forward.values() for m in calls))
        every = [c for calls in by_forward.values() for module_calls in calls.values() for c in module_calls]
        tensors = [t for c in every for t in _tensors_of(c)]
        common = {
            "samples": float(sum(samples.values())),
            "within_clip": within,  # samples whose gradient norm was at most the clip (a number)
            "passes": {next(self.passes): (frozenset(by_forward), modules)},
            "clips": frozenset({clip}),
            "expected": frozenset({expected}),
            # Those the backward ran in (bfloat16 under autocast), for the add-up check.
            "dtypes": frozenset(t.dtype for t in tensors if t.is_floating_point()),
        }
        return {p: {"sum": total, "unclipped": unclipped.get(p), **common} for p, total in out.items()}

    def _by_forward(self, entries: Sequence[tuple[Call, Any]]) -> dict[Any, _Calls]:
        """The calls of a pass by the model's forward they came from, then by module (frozen ones left out)."""
        shared = {m for param, uses in self.shared.items() if param.requires_grad for m, _ in uses}
        trains = {m: bool(self._trained_names(m)) or m in shared for m in {c.module for _, c in entries}}
        by_forward: dict[Any, _Calls] = {}
        for _, call in entries:
            if trains[call.module]:
                by_forward.setdefault(call.forward, {}).setdefault(call.module, []).append(call)
        return by_forward

    def _samples(self, forward: Any, calls: _Calls) -> int:
        """The samples every call of one forward holds; refused where no tensor argument of the model has that many."""
        batch_dim, capture = self.batch_dim, self.capture
        sizes = {m: {_samples_of(m, _batch_first(c, batch_dim)) for c in cs} for m, cs in calls.items()}
        shapes = capture.model_input_shapes(forward)
        given = {int(shape[batch_dim]) for shape in shapes or () if len(shape) > batch_dim}
        try:
            count = self._agreed_batch(sizes, given)
        except RuntimeError:
            self._refuse_recurrent_layout(calls, shapes or [])  # the likely cause, said with its own numbers
            raise
        if count in given and count > 1:
            batched = [s for s in shapes or () if len(s) > batch_dim]
            self._refuse_broadcast_inputs(calls, batched, count, capture.samples_of_calls(forward))
        if not given or count in given or any(m is capture.root for m in calls):
            return count  # agrees, or the model is itself a layer whose call says what its samples are
        self._refuse_recurrent_layout(calls, shapes or [])
        called = ", ".join(capture.name(m) for m in list(calls)[:3])
        raise RuntimeError(
            f"the layers called in one forward ({called}, ...) hold {count} samples along dim {batch_dim}, but no "
            f"tensor argument of the model has {count} there (it has {sorted(given)}): a layer sees the batch along "
            "another dimension, and sequence-first tensors (T, B, ...) would be clipped per time step, not per "
            "sample; or each call holds one sample (a layer called on one sample at a time, its input without the "
            "batch dimension), where DP clips a sample by its row in every call; or a layer gets a PackedSequence's "
            ".data, whose rows are the tokens of every sequence. Pass batch_dim=1 if every layer gets (T, B, ...), "
            "keep the batch first throughout (batch_first=True, padded sequences rather than packed), and call "
            "each layer on the whole batch. No parameter was changed"
        )

    def _refuse_recurrent_layout(self, calls: _Calls, shapes: list[torch.Size]) -> None:
        """Refuse a forward whose batch check failed inside one of Opacus's recurrent layers (``DPLSTM``, ``DPGRU``,
        ``DPRNN``: a linear layer per gate, called once per time step on ``(B, features)``) fed sequence-first or
        packed input, or read with ``batch_dim=1``, naming it, with the batch and steps its calls hold."""
        found = _recurrent_calls(self.capture.root, calls)
        if not found:
            return
        recurrent, inner = next(iter(found.items()))
        name = f"{self.capture.name(recurrent)} ({type(recurrent).__name__})"
        layers = ", ".join(self.capture.name(m) for m in list(inner)[:2])
        first = [c.args[0] for c in next(iter(inner.values())) if c.args and isinstance(c.args[0], Tensor)]
        if not first or first[0].dim() != 2:
            return
        # Each call is one time step on its batch (a PackedSequence's shrinks as sequences end: largest first).
        steps, features = sorted((int(x.shape[0]) for x in first), reverse=True), int(first[0].shape[1])
        batch, batch_first = steps[0], bool(getattr(recurrent, "batch_first", False))
        fix = _padded_advice(batch, len(steps), batch_first, self.batch_dim)
        if len(set(steps)) > 1:
            shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
            raise RuntimeError(
                f"{name} got a PackedSequence: its layers ({layers}) are called once per time step on the "
                f"sequences still running, batches of {shown} (a batch of {batch} sequences, the longest "
                f"{len(steps)} steps), but DP clips a sample by its row in every call of the forward, so each call "
                f"must hold the whole batch. {fix}"
            )
        if self.batch_dim == 1:
            raise RuntimeError(
                f"{name} is read with batch_dim=1, but its layers ({layers}) are called once per time step on "
                f"(B, features) tensors, ({batch}, {features}) here: their dim 1 holds features, not samples. "
                f"Opacus's recurrent layers hand every layer the batch first. {fix}"
            )
        if not batch_first:
            seen = next((s for s in shapes if len(s) > 1 and s[1] == batch), shapes[0] if shapes else None)
            held = f"the model's input {tuple(seen)}" if seen is not None else "the model's input"
            raise RuntimeError(
                f"{name} got sequence-first input (T, B, ...), batch_first=False: its layers ({layers}) are called "
                f"once per time step, {len(steps)} steps on a batch of {batch} samples each, while {held} holds "
                f"the batch along dim 1, and DP counts each forward's samples along dim 0 of the model's inputs. "
                f"{fix}"
            )

    def _agreed_batch(self, sizes: dict[nn.Module, set[int]], given: set[int]) -> int:
        """The batch every call of a forward holds; refused, naming the calls that hold another."""
        found = set().union(*sizes.values())
        count = max(found)
        if len(found) > 1:  # the batch: the one size the model's input has, else the most common
            known = found & given
            count = known.pop() if len(known) == 1 else max(found, key=lambda n: sum(n in s for s in sizes.values()))
        odd = {self.capture.name(m): sorted(s) for m, s in sizes.items() if s != {count}}
        if odd and count > 1 and all(s == [1] for s in odd.values()):
            raise RuntimeError(
                f"the input of {', '.join(odd)} has a batch dimension of 1 while the forward's batch is {count}: "
                "broadcast over the samples (like position ids of shape (1, T)), its output gradient sums over them. "
                "Pass that input expanded to the batch (Hugging Face: position_ids=torch.arange(T).expand(B, T)). "
                "No parameter was changed"
            )
        if odd:
            raise RuntimeError(
                f"the calls of one forward disagree on its batch size: it holds {count} samples, but {odd}. "
                "Either those inputs are not batched (positions torch.arange(T): pass them expanded to the batch; "
                "T5's relative_attention_bias, whose output is broadcast over "
                "the samples: leave its parameters out of the optimizer, or freeze them with requires_grad_(False)), "
                "or some layers see the batch along another dimension (sequence-first tensors: see batch_dim), or "
                "are called on one sample at a time (an input without its batch dimension: call them on the batch). "
                "No parameter was changed"
            )
        return count

    def _refuse_broadcast_inputs(
        self, calls: _Calls, shapes: list[torch.Size], count: int, verdicts: dict[nn.Module, Any] | None
    ) -> None:
        """Refuse calls whose rows pass for samples by their size but are not (outputs broadcast over the samples):
        as the computation followed them (``Capture.follow_samples``), by their sizes where it did not tell."""
        root = self.capture.root  # (a parameter or a buffer, as a memory bank of keys)
        # (by their local tensors: a DTensor's own data_ptr() is 0, the same for every one)
        named = [(n, local_tensor(t)) for n, t in [*root.named_buffers(), *root.named_parameters()]]
        params = {(t.data_ptr(), t.shape): n for n, t in named if t.data_ptr() != 0}
        for module, module_calls in calls.items():
            first = module_calls[0].args[0] if module_calls[0].args else None
            if not isinstance(first, Tensor):
                continue
            local = local_tensor(first)
            found = local.is_floating_point() and local.data_ptr() != 0
            name = params.get((local.data_ptr(), local.shape)) if found else None
            if name is not None:
                raise RuntimeError(
                    f"{self.capture.name(module)} is called on the model's tensor {name} itself, the same for every "
                    "sample: its output is broadcast over the batch, so its gradient cannot be clipped per sample. "
                    f"Expand it to the batch before the call ({name}.expand(B, ...)), or freeze that layer. No "
                    "parameter was changed"
                )
            verdict, how = (verdicts or {}).get(module, (UNKNOWN, None))
            if verdict == BROADCAST:
                raise RuntimeError(_broadcast_message(self.capture.name(module), first, how))
            if verdict == UNKNOWN:
                why = (
                    "the forward ran compiled, where DP does not follow the samples through it"
                    if verdicts is None
                    else "its output never met the samples within the forward, so the computation did not tell"
                )
                self._refuse_by_sizes(module, first, shapes, count, why)

    def _refuse_by_sizes(
        self, module: nn.Module, first: Tensor, shapes: list[torch.Size], count: int, why: str
    ) -> None:
        """Where the computation did not tell (``why``): indices with fewer dimensions than the model's batched
        input, whose batch equals another of its dimensions, are likely positions broadcast over the samples."""
        batched = [s for s in shapes if s[self.batch_dim] == count]
        others = {int(n) for s in batched for d, n in enumerate(s) if d != self.batch_dim}
        if count in others and not first.is_floating_point() and first.dim() < min(map(len, batched)):
            raise RuntimeError(
                f"{self.capture.name(module)} is called with indices of shape {tuple(first.shape)}, fewer "
                f"dimensions than the model's input {tuple(batched[0])}, whose batch ({count}) equals another "
                "of its dimensions: they are likely positions (torch.arange(T)) broadcast over the samples, "
                f"whose gradient cannot be clipped per sample, and shapes cannot tell them from samples here ({why}). "
                "Pass them expanded to the batch (torch.arange(T).expand(B, T)), or pass per-sample indices to the "
                "model as an argument. No parameter was changed"
            )

    def combine(self, a: Any, b: Any) -> Any:
        if a is None or "error" in b:
            return b
        if "error" in a:
            return a
        out = {k: a[k] + b[k] for k in ("sum", "samples", "within_clip")}
        out |= {k: a[k] | b[k] for k in ("passes", "clips", "expected", "dtypes")}
        return out | {"unclipped": add_statistics(a["unclipped"], b["unclipped"])}

    def _per_sample(self, module: nn.Module, call: Call, names: Sequence[str]) -> PerSample:
        """One call's per-sample gradients: a closed form (on the call with the batch moved first), or
        ``vmap(grad)`` over the module's forward, called as it was (batch along ``batch_dim``). Under tensor
        parallelism, this rank's part of them, from the local tensors its layer computed with."""
        kind = layer_kind(module)
        if kind is not None and kind.provides("per_sample"):
            call = local_call(call, grads=True)
            weight = module._parameters.get(kind.weight_name)
            if weight is not None and weight in self.parts and isinstance(kind, (LinearKind, EmbeddingKind)):
                return self._tensor_parallel_part(module, call, names, weight)
            return kind.per_sample(module, _batch_first(call, self.batch_dim), names)
        return Materialized(_functional_per_sample_grads(module, call, names, self.batch_dim))

    def _tensor_parallel_part(self, module: nn.Module, call: Call, names: Sequence[str], weight: Tensor) -> PerSample:
        """This rank's part of one call's per-sample gradients of a layer tensor parallelism splits (``call``
        local): a ``Linear``'s or an ``Embedding``'s output gradient narrowed to the output features this rank
        holds where the layer's output was gathered (``output_layouts=Replicate()``), an ``Embedding``'s rows to
        the rows it holds."""
        kind, placement = layer_kind(module), self.layout.tensor_placements(weight)[0]
        features = 0 if isinstance(kind, LinearKind) else 1  # (the weight dimension of the output features)
        grad, held = call.grad_output, self.parts[weight][features]
        if shard_dim(placement) == features and grad is not None and grad.shape[-1] != held:
            rows = self.layout.tensor_range(weight, features)
            call = Call(call.module, call.args, call.kwargs, [grad[..., rows.start : rows.stop]], call.forward)
        if isinstance(kind, LinearKind) and grad is not None and call.input.shape[:-1] != call.grad_output.shape[:-1]:  # type: ignore[union-attr]
            raise RuntimeError(
                f"under tensor parallelism the output gradient of {self.name(module)} has shape "
                f"{tuple(call.grad_output.shape)} but its input {tuple(call.input.shape)}: its output is split over "  # type: ignore[union-attr]
                "the ranks along another dimension than its features (output_layouts=Shard(1), sequence "
                "parallelism after it), so no rank holds every position of a sample. Keep the default output_layouts "
                "of the layers DP trains"
            )
        per = kind.per_sample(module, _batch_first(call, self.batch_dim), names)  # type: ignore[union-attr]
        if isinstance(per, MatrixRows):
            per.weight_shape = self.parts[weight]
        elif isinstance(per, IndexedRows) and shard_dim(placement) == 0:
            per = per.within(self.layout.tensor_range(weight))
        return per

    def _share(self, module: nn.Module, call: Call, name: str) -> Tensor:
        return self._per_sample(module, call, [name]).grads()[name]

    def _empty_sums(self, calls: _Calls) -> _Sums:
        """Zero sums for every parameter a forward without samples reaches (the step adds the noise alone)."""
        params: list[Tensor] = [module._parameters[n] for module in calls for n in self._trained_names(module)]  # type: ignore[misc]
        params += [p for p, uses in self.shared.items() if p.requires_grad and any(m in calls for m, _ in uses)]
        sums = {p: _zeros(p, torch.promote_types(p.dtype, torch.float32), self.sum_shape(p)) for p in params}
        return sums, ({p: self.probes.project(p, s) for p, s in sums.items()} if self.verify else {}), 0.0

    def _clipped_sums(self, calls: _Calls, scale: float, clip: float) -> _Sums:
        """One forward's samples clipped (each over every parameter) and summed; when ``verify``, unclipped too."""
        with record_function("DP: per-sample norms"):
            pieces = self._pieces(calls)
            norms = [self._located(piece.module, piece.calls, calls, piece.per.sq_norms) for piece in pieces]
            squared = _over_tensor_parallel_ranks(pieces, [n.double() for n in norms])
            norms_of_samples = scale * squared.sqrt()  # each sample's own gradient's (its loss's share times scale)
            # One read per pass, of both: whether every norm is finite (each is if their sum is), and how many
            # samples' norms are at most the clip (Andrew et al.'s b_i = 1[|g_i| <= C]). (Summed over the tensor
            # parallel group first: every rank of it reads the same and takes the same branch.)
            read = torch.stack([torch.isfinite(squared).all().double(), _within(norms_of_samples, clip)])
            finite, within = read.tolist()
            if not finite:  # (overflowed in float32: those norms again, in float64)
                robust = [_robust_sq_norms(piece.per, n) for piece, n in zip(pieces, norms, strict=True)]
                squared = _over_tensor_parallel_ranks(pieces, robust)
                norms_of_samples = scale * squared.sqrt()
                within = _within(norms_of_samples, clip).item()
        weights = scale * (clip / (norms_of_samples + 1e-6)).clamp(max=1.0)
        sums: dict[Tensor, Tensor] = {}
        plain: dict[Tensor, Tensor] = {}
        with record_function("DP: clipped sums"):
            for piece in pieces:
                clipped = self._located(piece.module, piece.calls, calls, piece.per.weighted_sum, weights)
                _add_into(sums, {piece.params[n]: t for n, t in clipped.items()}, promote=True)
        with record_function("DP: add-up sums"):
            for piece in pieces if self.verify else ():
                args = (piece.per, piece.params, len(weights))
                unclipped = self._located(piece.module, piece.calls, calls, self.probes.plain_sums, *args)
                _add_into(plain, {piece.params[n]: t for n, t in unclipped.items()})
        return sums, plain, within

    def _pieces(self, calls: _Calls) -> list[_Piece]:
        """One forward's per-sample gradients: a piece per module (its calls merged) and per shared weight."""
        pieces = []
        for module, module_calls in calls.items():
            names = self._trained_names(module)
            for part, group, partial in self._parts(module, names, module_calls[0]) if names else ():
                per_call = [self._located(module, [c], calls, self._per_sample, module, c, part) for c in module_calls]
                merged = self._located(module, module_calls, calls, _merged, per_call)
                if partial is not None:  # each rank's share of every sample's gradient (its positions): summed
                    grads = {n: g.clone() for n, g in merged.grads().items()}
                    all_reduce_sum_(list(grads.values()), partial)
                    merged = Materialized(grads)
                pieces.append(_Piece(merged, {n: module._parameters[n] for n in part}, module, module_calls, group))  # type: ignore[misc]
        for param, uses in self.shared.items():  # a weight several modules use: add their shares
            if not param.requires_grad:
                continue
            shares = [self._located(m, [c], calls, self._share, m, c, n) for m, n in uses for c in calls.get(m, ())]
            if shares:
                every = [c for m, _ in uses for c in calls.get(m, ())]
                per = Materialized({"shared": torch.stack(shares).sum(0)})
                pieces.append(_Piece(per, {"shared": param}, uses[0][0], every))
        return pieces

    def _parts(self, module: nn.Module, names: list[str], call: Call) -> list[tuple[list[str], Any, Any]]:
        """``module``'s trained parameters ``names`` by how tensor parallelism holds their per-sample gradients:
        ``(names, group, partial)``, ``group`` the ranks whose squared norms add up (split parameters; ``None``:
        counted once), ``partial`` the ranks whose per-sample gradients add up (a replicated parameter whose layer
        sees part of each sample's positions, as under SequenceParallel; else ``None``)."""
        split = [n for n in names if module._parameters[n] in self.split]
        if not split and not any(module._parameters[n] in self.parts for n in names):
            return [(names, None, None)]
        whole = [n for n in names if n not in split]
        parts = [(split, self.split[module._parameters[split[0]]], None)] if split else []  # type: ignore[index]
        return parts + ([(whole, None, self._positions_split(module, call))] if whole else [])

    def _positions_split(self, module: nn.Module, call: Call) -> Any:
        """The group over which ``call``'s input is split along positions (a sequence dimension), or ``None``."""
        first = call.args[0] if call.args else None
        if not isinstance(first, Tensor) or getattr(first, "device_mesh", None) is None:
            return None
        for d, placement in enumerate(first.placements):  # type: ignore[attr-defined]
            dim = shard_dim(placement)
            if dim is None or dim % first.dim() == first.dim() - 1:
                continue  # (its features: a row-sharded Linear's, whose replicated bias sees whole samples)
            if dim % first.dim() == self.batch_dim:
                raise RuntimeError(
                    f"under tensor parallelism the input of {self.name(module)} is split over the ranks along its "
                    f"batch dimension ({placement}): each rank holds other samples, whose gradients DP clips apart. "
                    "Split the batch with FSDP2 or DistributedDataParallel instead"
                )
            return first.device_mesh.get_group(d)  # type: ignore[attr-defined]
        return None

    def _located(self, module: nn.Module, failed: list[Call], calls: _Calls, compute: Any, *args: Any) -> Any:
        """``compute(*args)``, an error in it raised as ``_Located`` at ``module``'s ``failed`` calls."""
        try:
            return compute(*args)
        except Exception as error:
            every = calls.get(module, [])
            shapes = ", ".join(
                "x".join(map(str, t.shape)) for c in failed for t in tree_flatten(c.args)[0] if isinstance(t, Tensor)
            )
            if len(failed) == 1 and failed[0] in every:
                which = f"call {every.index(failed[0]) + 1} of {len(every)} in one forward"
            else:
                which = f"its {len(failed)} call(s) in one forward"
            where = f"{self.name(module)} ({type(module).__name__}), {which}, on inputs of shape {shapes or '()'}"
            raise _Located(where, error) from error


class _Piece(NamedTuple):
    """The per-sample gradients of one module's calls in one forward (or of one shared weight)."""

    per: PerSample
    params: dict[str, Tensor]  # name in ``per`` -> parameter
    module: nn.Module  # where an error in it is located
    calls: list[Call]
    group: Any = None  # tensor parallelism: the ranks holding the other parts of these per-sample gradients


def _tensor_parallel_parts(
    layout: ParallelLayout, trained: set[Tensor]
) -> tuple[dict[Tensor, torch.Size], dict[Tensor, Any]]:
    """The shape of this rank's part of each parameter tensor parallelism holds (split or replicated), and the
    group each split one is split over."""
    parts = {p: layout.tensor_local_shape(p) for p in trained if layout.tensor_dims(p)}
    split = {
        p: layout.tensor_group(p)
        for p in parts
        if any(shard_dim(placement) is not None for placement in layout.tensor_placements(p))
    }
    return parts, split


def _over_tensor_parallel_ranks(pieces: list[_Piece], squared: list[Tensor]) -> Tensor:
    """Each sample's squared norm over every parameter: the pieces' ``squared`` norms added, those of parameters
    tensor parallelism splits summed over their group (one all-reduce per group), the others counted once."""
    total: Any = 0.0
    groups: dict[Any, Any] = {}
    for piece, part in zip(pieces, squared, strict=True):
        if piece.group is None:
            total = total + part
        else:
            groups[piece.group] = groups.get(piece.group, 0.0) + part
    for group, part in groups.items():  # (in the pieces' order, the same on every rank)
        part = part.clone()
        torch.distributed.all_reduce(part, group=group)
        total = total + part
    return total


def _tensors_of(call: Call) -> list[Tensor]:
    """A call's tensor arguments and output gradients."""
    grads = call.grad_outputs if call.has_grad_outputs else ()
    return [t for t in (*grads, *call.args) if isinstance(t, Tensor)]


def _within(norms: Tensor, clip: float) -> Tensor:
    """How many of ``norms`` are at most ``clip`` (float64, 0-d)."""
    return (norms <= clip).sum(dtype=torch.float64)


def _zeros(param: Tensor, dtype: torch.dtype, shape: torch.Size | None = None) -> Tensor:
    return torch.zeros(param.shape if shape is None else shape, dtype=dtype, device=local_tensor(param).device)


def _add_into(totals: dict[Tensor, Any], more: dict[Tensor, Tensor], promote: bool = False) -> None:
    """Add ``more`` into ``totals``, parameter by parameter (``promote``: in float32 at least)."""
    for param, total in more.items():
        if promote:
            total = total.to(torch.promote_types(param.dtype, torch.float32))
        totals[param] = add_statistics(totals.get(param), total)


class _Located(Exception):
    """An error of the per-sample code, as ``(where, error)``: the module and call it came from, and the error."""


class _Probes:
    """The per-sample gradients' sum, for the add-up check: a weight's projected on 4 fixed random
    output directions ``P`` (``Pᵀ sum_t g_t x_tᵀ = sum_t (Pᵀ g_t) x_tᵀ``, ``O(N (in + out))``; a difference
    ``D`` with ``Pᵀ D = 0`` has probability zero), everything else summed exactly."""

    def __init__(self) -> None:
        self.directions: dict[Tensor, Tensor] = {}  # weight -> P, fixed for the optimizer's life
        self.transposed: set[Tensor] = set()  # weights stored (in, out), as Hugging Face's Conv1D
        self.generator = torch.Generator().manual_seed(0)

    def _directions(self, param: Tensor, outputs: int, like: Tensor) -> Tensor:
        directions = self.directions.get(param)
        if directions is None:
            drawn = torch.randn(outputs, 4, generator=self.generator, dtype=torch.float64)
            directions = self.directions[param] = (drawn / math.sqrt(4)).to(like.device, like.dtype)
        return directions if directions.dtype == like.dtype else directions.to(like.dtype)

    def plain_sums(self, per: PerSample, params: dict[str, Tensor], batch: int) -> dict[str, Tensor]:
        if isinstance(per, MatrixRows) and per.weight and params["weight"].numel() > 0:  # (else nothing to project)
            weight = params["weight"]
            if per.transposed:
                self.transposed.add(weight)
            return per.projected_sums(self._directions(weight, per.outputs, per.like))
        if isinstance(per, BlockRows) and per.weight and params["weight"].numel() > 0:
            projected = per.g @ self._directions(params["weight"], per.g.shape[-1], per.g)  # (b, blocks, t, 4)
            out = {"weight": torch.einsum("bjtk,bjti->jki", projected, per.x)}
            if per.bias:
                out["bias"] = per.g.sum((0, 2)).reshape(-1)
            return out
        return per.weighted_sum(torch.ones(batch, dtype=torch.float64))

    def project(self, param: Tensor, grad: Tensor) -> Tensor:
        """``grad`` (made dense) as ``plain_sums`` represents the parameter's sum (projected, or as it is)."""
        grad = grad.to_dense() if grad.is_sparse else grad
        directions = self.directions.get(param)
        if directions is None:
            return grad
        directions = directions.to(grad.device, grad.dtype)
        outputs = directions.shape[0]
        if param in self.transposed:
            return directions.T @ grad.T
        blocks = grad.shape[0] // outputs
        if blocks == 1:
            return directions.T @ grad.reshape(outputs, -1)
        return torch.einsum("ok,joi->jki", directions, grad.reshape(blocks, outputs, -1))


def _unsupported(module: nn.Module, trained: set[Tensor]) -> str | None:
    """Why the per-sample gradients of ``module``'s ``trained`` parameters cannot be computed (or None)."""
    own = [n for n, p in module._parameters.items() if p is not None and p in trained]
    reaches = any(p in trained for p in module.parameters())
    kind = layer_kind(module)
    unknown = [n for n in own if kind is not None and n not in (kind.weight_name, kind.bias_name)]
    if (declared := layers.declared_refusal(module)) is not None and reaches:
        return declared
    if any(module._parameters[n].is_complex() for n in own):  # type: ignore[union-attr]
        return "its parameters are complex; per-sample clipping here handles real parameters only"
    if getattr(module, "scale_grad_by_freq", False) and own:
        return (
            "scale_grad_by_freq=True divides each row's gradient by how often the whole batch used it, so a "
            "sample's gradient depends on the others. Construct it with scale_grad_by_freq=False"
        )
    if isinstance(module, (nn.RNNBase, nn.RNNCellBase)) and own:
        return (
            "torch.func has no per-sample rule for its fused recurrent kernel. Use opacus.layers.DPLSTM / DPGRU / "
            "DPRNN (built from linear layers, exact here with batch_first=True on padded tensors), or write the "
            "recurrence with nn.Linear"
        )
    if parametrize.is_parametrized(module) and reaches:
        parametrized: nn.ModuleDict = module.parametrizations  # type: ignore[assignment]
        return (
            f"its {', '.join(parametrized)} is computed by a parametrization (weight_norm, spectral_norm) called "
            "without the batch, so its trained tensors get no per-sample gradient. Remove it before training with "
            "DP (torch.nn.utils.parametrize.remove_parametrizations), or normalize activations (LayerNorm, GroupNorm)"
        )
    if unknown:
        return (
            f"its parameters {', '.join(unknown)} are not the weight and bias its layer is computed with (a "
            "pruning, weight_norm or spectral_norm hook derives the weight from them). Remove the hook before "
            "training with DP (torch.nn.utils.prune.remove, remove_weight_norm, remove_spectral_norm)"
        )
    return None


def _robust_sq_norms(per: PerSample, squared: Tensor) -> Tensor:
    """``squared`` (``per.sq_norms()``), recomputed in float64 where it overflowed (an infinite norm clips to 0)."""
    if squared.dtype == torch.float64 or bool(torch.isfinite(squared).all()):
        return squared.double()
    if isinstance(per, MatrixRows):
        return per.widened().sq_norms()
    if isinstance(per, IndexedRows):
        return IndexedRows(per.index, per.g.double(), per.num_rows).sq_norms()
    return Materialized({n: g.double() for n, g in per.grads().items()}).sq_norms()


def _samples_of(module: nn.Module, call: Call) -> int:
    """How many samples one call holds: its kind's count (read directly in the common case, without a pytree)."""
    kind, first = layer_kind(module) or layers.GENERIC, call.args[0] if call.args else None
    if type(kind).samples is layers.LayerKind.samples and type(first) is Tensor and first.dim() > 0:
        return int(first.shape[0])
    return kind.samples(module, call)  # (a 0-d input: its error)


def _broadcast_message(name: str, first: Tensor, how: str | None) -> str:
    """Why a layer whose output the computation found broadcast over the samples is refused, and what to do."""
    where = f" ({how})" if how else ""
    if not first.is_floating_point():
        return (
            f"{name} is called with indices of shape {tuple(first.shape)}, and its output is broadcast over the "
            f"samples{where}: its gradient there is the sum over the samples, which cannot be clipped per sample. "
            "The indices are likely positions (torch.arange(T)): pass them expanded to the batch "
            "(torch.arange(T).expand(B, T)) or as per-sample indices to the model, or freeze that layer "
            "(requires_grad_(False)). No parameter was changed"
        )
    return (
        f"{name} is called on an input of shape {tuple(first.shape)}, and its output is broadcast over the "
        f"samples{where}: its gradient there is the sum over the samples, which cannot be clipped per sample. "
        "Expand its input to the batch before the call (x.expand(B, ...)), or freeze that layer "
        "(requires_grad_(False)). No parameter was changed"
    )


def _padded_advice(batch: int, steps: int, batch_first: bool, batch_dim: int) -> str:
    """What to feed one of Opacus's recurrent layers instead: padded, batch-first tensors."""
    return (
        f"{'Pass' if batch_first else 'Construct it with batch_first=True and pass'} it padded (B, T, ...) "
        f"tensors, ({batch}, {steps}, ...) here (torch.nn.utils.rnn.pad_packed_sequence(..., batch_first=True) or "
        f"pad_sequence(..., batch_first=True); mask the padded steps out of the loss)"
        f"{', with batch_dim=0' if batch_dim else ''}. No parameter was changed"
    )


def _recurrent_calls(root: nn.Module, calls: _Calls) -> dict[nn.Module, _Calls]:
    """The calls of ``calls`` inside each of Opacus's recurrent layers (``opacus.layers.DPRNNBase``) of ``root``."""
    dp_rnn = sys.modules.get("opacus.layers.dp_rnn")  # (loaded if the model holds one)
    base = getattr(dp_rnn, "DPRNNBase", None)
    if base is None:
        return {}
    found: dict[nn.Module, _Calls] = {}
    for recurrent in (m for m in root.modules() if isinstance(m, base)):
        inner = {m: calls[m] for m in recurrent.modules() if m in calls}  # (in the layer's order: input gates first)
        if inner:
            found[recurrent] = inner
    return found


def _batch_first(call: Call, batch_dim: int) -> Call:
    """``call`` with ``batch_dim`` moved to the front in every tensor argument and output gradient that
    has the batch there (the first tensor argument's size); others (a shared mask) stay as they are."""
    if batch_dim == 0:
        return call
    first = next((t for t in tree_flatten(call.args)[0] if isinstance(t, Tensor) and t.dim() > batch_dim), None)
    if first is None:
        return call
    batch = first.shape[batch_dim]

    def moved(x: Any) -> Any:
        batched = isinstance(x, Tensor) and x.dim() > batch_dim and x.shape[batch_dim] == batch
        return x.movedim(batch_dim, 0) if batched else x

    grads = [moved(g) for g in call.grad_outputs] if call.has_grad_outputs else None
    kwargs = {k: moved(v) for k, v in call.kwargs.items()}
    return Call(call.module, tuple(moved(a) for a in call.args), kwargs, grads, call.forward)


def _merged(per_call: list[PerSample]) -> PerSample:
    """The per-sample gradients of several calls of one module in one forward, summed."""
    if len(per_call) == 1:
        return per_call[0]
    if all(isinstance(p, MatrixRows) for p in per_call):
        return merged_rows(per_call)  # type: ignore[arg-type]
    grads = [p.grads() for p in per_call]
    return Materialized({n: torch.stack([g[n] for g in grads]).sum(0) for n in grads[0]})
