"""Per-sample gradients in the forms that are cheapest to reduce (DP-SGD's clipping): a layer's ``LayerKind``
builds one from a call (``LayerKind.per_sample``), DP reads each sample's squared norm and a weighted sum."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ._torch import tree_flatten, tree_unflatten
from .inputs import Call

__all__ = ["BlockRows", "IndexedRows", "Materialized", "MatrixRows", "PerSample", "merged_rows"]


class PerSample:
    """One call's per-sample gradients, in whichever form is cheapest to reduce."""

    def sq_norms(self) -> Tensor:
        """Each sample's squared gradient norm over the parameters: ``(batch,)``."""
        rows = [g.reshape(g.shape[0], math.prod(g.shape[1:])) for g in self.grads().values()]  # (a 0-element one too)
        return torch.stack([r.pow(2).sum(1) for r in rows]).sum(0)

    def weighted_sum(self, weights: Tensor) -> dict[str, Tensor]:
        """``sum_i weights[i] * (sample i's gradient)`` for each parameter."""
        return {n: torch.tensordot(weights.to(g), g, dims=1) for n, g in self.grads().items()}

    def grads(self) -> dict[str, Tensor]:
        """The per-sample gradients themselves, ``(batch, *parameter shape)`` per parameter."""
        raise NotImplementedError


class Materialized(PerSample):
    def __init__(self, grads: dict[str, Tensor]) -> None:
        self._grads = grads

    def grads(self) -> dict[str, Tensor]:
        return self._grads


class MatrixRows(PerSample):
    """A matrix layer's per-sample gradients from inputs ``x`` ``(batch, positions, in)`` and output
    gradients ``g`` ``(batch, positions, out)`` (any strides): sample ``b``'s weight gradient is
    ``sum_t g_bt x_btᵀ``, its bias gradient ``sum_t g_bt``. The squared norm is the cheaper exact form:
    the ghost norm (Gram matrices over the positions), or the gradient itself (``formed``, ``(batch, out,
    in)``) where it is no larger than the rows (``positions * (in + out) >= in * out``), then kept for the
    sums. Otherwise the clipped sum is Book-Keeping's one product ``gᵀ diag(c) x``. Given ``formed``,
    ``x`` and ``g`` are not needed."""

    def __init__(
        self,
        x: Tensor | None,
        g: Tensor | None,
        names: Sequence[str],
        weight_shape: torch.Size,
        transposed: bool = False,
        *,
        formed: Tensor | None = None,
        bias_rows: Tensor | None = None,
    ) -> None:
        self.weight, self.bias = "weight" in names, "bias" in names
        assert (x is not None and g is not None) or (
            (formed is not None or not self.weight) and (bias_rows is not None or not self.bias)
        )
        self.x, self.g = x, g
        self.names = [n for n in ("weight", "bias") if n in names]  # the parameters it holds the gradients of
        self.weight_shape = weight_shape
        self.transposed = transposed  # the weight is stored (in, out), as Hugging Face's Conv1D
        self.formed = formed  # (batch, out, in): each sample's weight gradient, once formed
        self._bias_rows = bias_rows

    @property
    def like(self) -> Tensor:
        """A tensor of the per-sample gradients' dtype and device, batch first."""
        like = self.g if self.g is not None else self.formed if self.formed is not None else self._bias_rows
        assert like is not None
        return like

    @property
    def outputs(self) -> int:
        """The weight's output rows (its first dimension, or its second when ``transposed``)."""
        return int(self.g.shape[-1] if self.g is not None else self.like.shape[1])

    @property
    def bias_rows(self) -> Tensor:
        """Each sample's bias gradient ``sum_t g_bt``: ``(batch, out)``."""
        if self._bias_rows is None:
            assert self.g is not None
            self._bias_rows = self.g[:, 0] if self.g.shape[1] == 1 else self.g.sum(1)
        return self._bias_rows

    def form(self) -> Tensor:
        """Each sample's weight gradient, ``(batch, out, in)`` (formed once)."""
        if self.formed is None:
            assert self.x is not None and self.g is not None
            self.formed = torch.bmm(self.g.transpose(1, 2), self.x)
        return self.formed

    def sq_norms(self) -> Tensor:
        total = self.bias_rows.square().sum(1) if self.bias else None
        if not self.weight:
            assert total is not None
            return total
        x, g = self.x, self.g
        if self.formed is not None or x is None or g is None or forms(x.shape[1], x.shape[2], g.shape[2]):
            squared = self.form().square().sum((1, 2))
        elif g.shape[1] == 1:  # one position: |g xᵀ|² = |g|² |x|²
            squared = g[:, 0].square().sum(1) * x[:, 0].square().sum(1)
        else:  # the ghost norm: |sum_t g_t x_tᵀ|² = sum_{t,s} (g_t . g_s)(x_t . x_s)
            squared = (torch.bmm(g, g.transpose(1, 2)) * torch.bmm(x, x.transpose(1, 2))).sum((1, 2))
        return squared if total is None else squared + total

    def weighted_sum(self, weights: Tensor) -> dict[str, Tensor]:
        weights = weights.to(self.like)
        sums = {}
        if self.weight:
            if self.formed is not None:
                matrix = torch.tensordot(weights, self.formed, dims=1)
            else:  # one product, the weights on the narrower side of the rows
                x, g = self.x, self.g
                assert x is not None and g is not None
                if x.shape[2] < g.shape[2]:
                    x = x * weights[:, None, None]
                else:
                    g = g * weights[:, None, None]
                matrix = g.flatten(0, 1).T @ x.flatten(0, 1)  # (flatten: a zero-width layer's rows too)
            sums["weight"] = (matrix.T if self.transposed else matrix).reshape(self.weight_shape)
        if self.bias:
            sums["bias"] = weights @ self.bias_rows
        return sums

    def projected_sums(self, directions: Tensor) -> dict[str, Tensor]:
        """The unclipped sum, its weight gradient projected on ``directions`` (``out x k``): ``k x in``."""
        out = {}
        if self.weight:
            if self.formed is not None:
                out["weight"] = directions.T @ self.formed.sum(0)
            else:  # sum_bt (Pᵀ g_bt) x_btᵀ: O(rows * k * (in + out))
                x, g = self.x, self.g
                assert x is not None and g is not None
                if g.shape[1] == 1 or g.is_contiguous():  # rows as they are (not a transposed view: 3x slower)
                    projected = (g.flatten(0, 1) @ directions).T  # (k, rows)
                    out["weight"] = projected @ x.flatten(0, 1)
                else:  # a convolution's channel-major rows: per sample, without copying them
                    projected = torch.matmul(directions.T, g.transpose(1, 2))  # (batch, k, positions)
                    out["weight"] = torch.bmm(projected, x).sum(0)
        if self.bias:
            out["bias"] = self.bias_rows.sum(0)
        return out

    def grads(self) -> dict[str, Tensor]:
        grads = {}
        if self.weight:
            matrix = self.form().transpose(1, 2) if self.transposed else self.form()
            grads["weight"] = matrix.reshape(matrix.shape[0], *self.weight_shape)
        if self.bias:
            grads["bias"] = self.bias_rows
        return grads

    def widened(self) -> MatrixRows:
        if self.x is None or self.g is None:
            assert self.formed is not None
            rows = None if self._bias_rows is None else self._bias_rows.double()
            return MatrixRows(
                None, None, self.names, self.weight_shape, self.transposed, formed=self.formed.double(), bias_rows=rows
            )
        return MatrixRows(self.x.double(), self.g.double(), self.names, self.weight_shape, self.transposed)


def forms(positions: int, inputs: int, outputs: int) -> bool:
    """Whether a per-sample weight gradient ``(out, in)`` is no larger than its rows (then it is formed)."""
    return positions > 1 and positions * (inputs + outputs) >= inputs * outputs


def merged_rows(per_call: list[MatrixRows]) -> MatrixRows:
    """Several calls of one matrix layer in one forward: their rows side by side, or the formed sum."""
    head = per_call[0]
    if all(p.x is not None and p.formed is None for p in per_call):
        x = torch.cat([p.x for p in per_call], dim=1)  # type: ignore[misc]
        g = torch.cat([p.g for p in per_call], dim=1)  # type: ignore[misc]
        return MatrixRows(x, g, head.names, head.weight_shape, head.transposed)
    formed = torch.stack([p.form() for p in per_call]).sum(0) if head.weight else None
    rows = torch.stack([p.bias_rows for p in per_call]).sum(0) if head.bias else None
    return MatrixRows(None, None, head.names, head.weight_shape, head.transposed, formed=formed, bias_rows=rows)


class BlockRows(PerSample):
    """``MatrixRows`` of a grouped convolution: ``x`` ``(batch, blocks, positions, in)``, ``g`` ``(batch,
    blocks, positions, out)``; block ``j`` owns output rows ``j * out ... (j + 1) * out - 1``."""

    def __init__(self, x: Tensor, g: Tensor, names: Sequence[str], weight_shape: torch.Size) -> None:
        self.x, self.g = x, g
        self.weight, self.bias = "weight" in names, "bias" in names
        self.weight_shape = weight_shape

    def sq_norms(self) -> Tensor:
        x, g = self.x, self.g
        positions, inputs, outputs = x.shape[2], x.shape[3], g.shape[3]
        total = g.new_zeros(g.shape[0])
        if self.bias:
            total = total + g.sum(2).pow(2).sum((1, 2))
        if not self.weight:
            return total
        if positions * (inputs + outputs) > inputs * outputs:  # forming each block's gradient is cheaper
            return total + torch.einsum("bkto,bkti->bkoi", g, x).pow(2).sum((1, 2, 3))
        # The ghost norm per block: |sum_t g_t x_t^T|^2 = sum_{t,s} (g_t . g_s)(x_t . x_s)
        return total + ((g @ g.transpose(2, 3)) * (x @ x.transpose(2, 3))).sum((1, 2, 3))

    def weighted_sum(self, weights: Tensor) -> dict[str, Tensor]:
        weighted = self.g * weights.to(self.g)[:, None, None, None]
        sums = {}
        if self.weight:
            sums["weight"] = torch.einsum("bkto,bkti->koi", weighted, self.x).reshape(self.weight_shape)
        if self.bias:
            sums["bias"] = weighted.sum((0, 2)).reshape(-1)
        return sums

    def grads(self) -> dict[str, Tensor]:
        grads = {}
        batch = self.g.shape[0]
        if self.weight:
            grads["weight"] = torch.einsum("bkto,bkti->bkoi", self.g, self.x).reshape(batch, *self.weight_shape)
        if self.bias:
            grads["bias"] = self.g.sum(2).reshape(batch, -1)
        return grads


class IndexedRows(PerSample):
    """A sample's gradient adds its output gradient ``g_t`` to the row of each index ``i_t`` it read
    (``-1``: padding, no gradient)."""

    def __init__(self, index: Tensor, g: Tensor, num_rows: int) -> None:
        self.index, self.g, self.num_rows = index, g, num_rows

    def within(self, rows: range) -> IndexedRows:
        """The same gradients restricted to the table's ``rows`` (a shard of them), indexed from its first."""
        inside = (self.index >= rows.start) & (self.index < rows.stop)
        return IndexedRows(torch.where(inside, self.index - rows.start, -1), self.g, len(rows))

    def sq_norms(self) -> Tensor:
        same_row = (self.index[:, :, None] == self.index[:, None, :]) & (self.index[:, :, None] >= 0)
        return (torch.bmm(self.g, self.g.transpose(1, 2)) * same_row).sum((1, 2))

    def weighted_sum(self, weights: Tensor) -> dict[str, Tensor]:
        kept = self.index.reshape(-1) >= 0
        rows = (self.g * weights.to(self.g)[:, None, None]).reshape(-1, self.g.shape[-1])[kept]
        total = self.g.new_zeros(self.num_rows, self.g.shape[-1])
        return {"weight": total.index_add_(0, self.index.reshape(-1)[kept], rows)}

    def grads(self) -> dict[str, Tensor]:
        grads = self.g.new_zeros(self.index.shape[0], self.num_rows + 1, self.g.shape[-1])  # last row: padding
        grads.scatter_add_(1, self.index.remainder(self.num_rows + 1)[..., None].expand_as(self.g), self.g)
        return {"weight": grads[:, :-1]}


def _functional_per_sample_grads(
    module: nn.Module, call: Call, names: Sequence[str], batch_dim: int = 0
) -> dict[str, Tensor]:
    """``vmap(grad)`` over the module's forward, one sample (along ``batch_dim``) at a time."""
    from torch.func import functional_call, grad, vmap

    if batch_dim:
        first = next((t for t in tree_flatten(call.args)[0] if isinstance(t, Tensor) and t.dim() > batch_dim), None)
        if first is None:
            raise RuntimeError(f"cannot tell the batch size of {call!r}: no tensor argument has dim {batch_dim}")
        batch = int(first.shape[batch_dim])
    else:
        batch = _batch_of(call)
    params = dict(module.named_parameters(recurse=False))
    wanted = {n: params[n].detach() for n in names}
    fixed = {n: t.detach() for n, t in [*params.items(), *module.named_buffers(recurse=False)] if n not in wanted}
    leaves, spec = tree_flatten((call.args, call.kwargs))
    batched = [
        i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.dim() > batch_dim and t.shape[batch_dim] == batch
    ]
    reached = [(i, g) for i, g in enumerate(call.grad_outputs) if g is not None]

    def one_sample(weights: dict[str, Tensor], samples: list[Tensor], grads: list[Tensor]) -> Tensor:
        # The module's output for one sample (as a batch of one), dotted with its output gradient.
        full = list(leaves)
        for i, sample in zip(batched, samples, strict=True):
            full[i] = sample.unsqueeze(batch_dim)
        args, kwargs = tree_unflatten(full, spec)
        outputs = tree_flatten(functional_call(module, {**weights, **fixed}, args, kwargs))[0]
        outputs = [t for t in outputs if isinstance(t, Tensor)]
        total = torch.zeros((), dtype=grads[0].dtype if grads else torch.float32)
        for (i, _), g in zip(reached, grads, strict=True):
            total = total + (outputs[i] * g.unsqueeze(batch_dim)).sum()
        return total

    samples = [leaves[i] for i in batched]
    return vmap(grad(one_sample), in_dims=(None, batch_dim, batch_dim))(wanted, samples, [g for _, g in reached])


def _batch_of(call: Call) -> int:
    first = next((t for t in tree_flatten(call.args)[0] if isinstance(t, Tensor)), None)
    if first is None or first.dim() == 0:
        raise RuntimeError(f"cannot tell the batch size of {call!r}: its first tensor argument has no batch dimension")
    return int(first.shape[0])
