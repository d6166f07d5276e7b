"""Per-layer helpers: how each layer type turns its captured calls into what rules use.

One ``LayerKind`` per layer type, registered with ``@register_layer``; a new layer type is
supported by registering one class here. Rules ask ``layer_kind(module)`` and use the
capabilities they need:

* Kronecker-factored rules (FOOF, K-FAC, NLMS) view a layer as ``y = W̃ x̃``: a weight
  matrix ``W̃`` (bias as its last column) acting on input rows ``x̃`` (a constant 1
  appended when the bias is included, the homogeneous coordinate).
* Lazy rules (LazyAdamW) ask which rows of an embedding table the step touched.
* Per-sample rules (DP) ask for each sample's squared gradient norm.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .inputs import Captured

__all__ = ["Layer", "LayerKind", "bias_of", "layer_kind", "register_layer", "weight_of"]

_REGISTRY: dict[type[nn.Module], LayerKind] = {}


def register_layer(*module_types: type[nn.Module]) -> Any:
    """Class decorator: register a ``LayerKind`` for ``module_types`` (and their subclasses)."""

    def register(cls: type[LayerKind]) -> type[LayerKind]:
        kind = cls()
        for module_type in module_types:
            _REGISTRY[module_type] = kind
        return cls

    return register


def layer_kind(module: nn.Module) -> LayerKind | None:
    """The registered ``LayerKind`` for ``module``'s type (or its nearest registered base), if it applies."""
    for cls in type(module).__mro__:
        kind = _REGISTRY.get(cls)
        if kind is not None:
            return kind if kind.supports(module) else None
    return None


class LayerKind:
    """How one layer type presents its calls and gradients to rules.

    A capability a layer type lacks raises ``NotImplementedError``; ``provides`` tells.
    """

    def supports(self, module: nn.Module) -> bool:
        """Whether this particular module (its configuration) is handled."""
        return True

    def provides(self, capability: str) -> bool:
        """Whether this kind implements ``capability`` (a method name of ``LayerKind``)."""
        return getattr(type(self), capability) is not getattr(LayerKind, capability)

    # -- Kronecker-factored view -----------------------------------------------------------
    def input_rows(self, module: nn.Module, entry: Captured, homogeneous: bool) -> Tensor:
        """The inputs as rows (float32 or wider) ``(samples, in_features [+1])``, over every call."""
        raise NotImplementedError(f"{type(module).__name__} has no input rows")

    def output_grad_rows(self, module: nn.Module, entry: Captured) -> Tensor:
        """The output gradients as rows (float32 or wider) ``(samples, out_features)``, matching ``input_rows``."""
        raise NotImplementedError(f"{type(module).__name__} has no output-gradient rows")

    def rows_per_sample(self, module: nn.Module, entry: Captured) -> int:
        """How many rows of ``input_rows`` each sample of the batch contributes (positions, patches)."""
        raise NotImplementedError(f"{type(module).__name__} has no input rows")

    def grad_matrix(self, module: nn.Module, homogeneous: bool) -> Tensor:
        """The gradient of ``W̃``: ``(out_features, in_features [+1])``, bias gradient last."""
        raise NotImplementedError(f"{type(module).__name__} has no weight matrix")

    def set_grad_matrix(self, module: nn.Module, matrix: Tensor, homogeneous: bool) -> None:
        """Write a ``grad_matrix``-shaped tensor back into the weight (and bias) gradients."""
        raise NotImplementedError(f"{type(module).__name__} has no weight matrix")

    # -- lazy rows -------------------------------------------------------------------------
    def touched_rows(self, module: nn.Module, entry: Captured) -> Tensor:
        """The sorted, unique rows of the weight that the captured calls read (an index tensor)."""
        raise NotImplementedError(f"{type(module).__name__} has no rows to touch")


def weight_of(module: nn.Module) -> Tensor:
    """``module.weight``, typed."""
    weight = module.weight
    assert isinstance(weight, Tensor), f"{type(module).__name__}.weight is not a tensor"
    return weight


def bias_of(module: nn.Module) -> Tensor | None:
    """``module.bias`` if the module has one, else ``None``."""
    bias = getattr(module, "bias", None)
    return bias if isinstance(bias, Tensor) else None


class Layer(NamedTuple):
    """A layer a rule preconditions: its module, kind, whether the bias joins the weight
    matrix (``homogeneous``: the bias exists and is trained by the optimizer), and the
    param group of its weight (where the rule reads its hyperparameters)."""

    module: nn.Module
    kind: LayerKind
    homogeneous: bool
    group: dict[str, Any]


def _statistics_dtype(x: Tensor) -> Tensor:
    """``x`` in float32, or in its own dtype if wider: statistics never accumulate in half precision."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _with_ones(rows: Tensor, homogeneous: bool) -> Tensor:
    if not homogeneous:
        return rows
    return torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)


def _matrix_grad(weight: Tensor, bias: Tensor | None, homogeneous: bool) -> Tensor:
    assert weight.grad is not None
    matrix = weight.grad.reshape(weight.shape[0], -1)
    if homogeneous:
        assert bias is not None and bias.grad is not None
        matrix = torch.cat([matrix, bias.grad.reshape(-1, 1)], dim=1)
    return matrix


def _set_matrix_grad(weight: Tensor, bias: Tensor | None, matrix: Tensor, homogeneous: bool) -> None:
    assert weight.grad is not None
    columns = weight.grad[0].numel()
    weight.grad.copy_(matrix[:, :columns].reshape(weight.grad.shape))
    if homogeneous:
        assert bias is not None and bias.grad is not None
        bias.grad.copy_(matrix[:, columns])


@register_layer(nn.Linear)
class LinearKind(LayerKind):
    """``nn.Linear``: every leading dimension of the input is a sample dimension."""

    def input_rows(self, module: nn.Module, entry: Captured, homogeneous: bool) -> Tensor:
        return _with_ones(_statistics_dtype(entry.rows()), homogeneous)

    def output_grad_rows(self, module: nn.Module, entry: Captured) -> Tensor:
        return _statistics_dtype(entry.grad_output_rows())

    def rows_per_sample(self, module: nn.Module, entry: Captured) -> int:
        x = entry.calls[0].input
        return 1 if x.dim() <= 2 else int(torch.tensor(x.shape[1:-1]).prod())

    def grad_matrix(self, module: nn.Module, homogeneous: bool) -> Tensor:
        return _matrix_grad(weight_of(module), bias_of(module), homogeneous)

    def set_grad_matrix(self, module: nn.Module, matrix: Tensor, homogeneous: bool) -> None:
        _set_matrix_grad(weight_of(module), bias_of(module), matrix, homogeneous)


@register_layer(nn.Conv2d)
class Conv2dKind(LayerKind):
    """``nn.Conv2d`` (``groups=1``): a linear map on unfolded input patches, one row per output position."""

    def supports(self, module: nn.Module) -> bool:
        return isinstance(module, nn.Conv2d) and module.groups == 1

    def _patches(self, module: nn.Conv2d, x: Tensor) -> Tensor:
        # Pad as the layer does (any padding mode, 'same' included), then unfold unpadded.
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
        patches = F.unfold(x, module.kernel_size, dilation=module.dilation, stride=module.stride)
        return patches.transpose(1, 2).reshape(-1, patches.shape[1])  # (batch * positions, C * kh * kw)

    def input_rows(self, module: nn.Module, entry: Captured, homogeneous: bool) -> Tensor:
        assert isinstance(module, nn.Conv2d)
        rows = torch.cat([self._patches(module, _statistics_dtype(_batched(x, 4))) for x in entry.inputs()])
        return _with_ones(rows, homogeneous)

    def output_grad_rows(self, module: nn.Module, entry: Captured) -> Tensor:
        grads = [_statistics_dtype(_batched(g, 4)) for g in entry.grad_outputs()]
        return torch.cat([g.permute(0, 2, 3, 1).reshape(-1, g.shape[1]) for g in grads])

    def rows_per_sample(self, module: nn.Module, entry: Captured) -> int:
        assert isinstance(module, nn.Conv2d)
        x = _batched(entry.calls[0].input, 4)
        return self._patches(module, x[:1]).shape[0]

    def grad_matrix(self, module: nn.Module, homogeneous: bool) -> Tensor:
        return _matrix_grad(weight_of(module), bias_of(module), homogeneous)

    def set_grad_matrix(self, module: nn.Module, matrix: Tensor, homogeneous: bool) -> None:
        _set_matrix_grad(weight_of(module), bias_of(module), matrix, homogeneous)


def _batched(x: Tensor, dims: int) -> Tensor:
    """An unbatched input (as the layer allows) with a batch dimension of one added."""
    return x if x.dim() == dims else x.unsqueeze(0)


@register_layer(nn.Embedding)
class EmbeddingKind(LayerKind):
    """``nn.Embedding``: the rows read are the indices it was called with (``padding_idx`` excluded)."""

    def touched_rows(self, module: nn.Module, entry: Captured) -> Tensor:
        rows = torch.unique(torch.cat([x.reshape(-1) for x in entry.inputs()]))
        padding = getattr(module, "padding_idx", None)
        return rows[rows != padding] if padding is not None else rows


@register_layer(nn.EmbeddingBag)
class EmbeddingBagKind(EmbeddingKind):
    """``nn.EmbeddingBag``: the indices of every bag (``padding_idx`` excluded)."""
