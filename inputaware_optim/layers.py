"""Per-layer helpers: one registered ``LayerKind`` per layer type turns its captured calls into what rules use.

Kronecker-factored rules (FOOF, K-FAC, NLMS) view a layer as ``y = W̃ x̃``: a weight matrix ``W̃``
(bias as its last column) on input rows ``x̃`` (a constant 1 appended when the bias is included).
Lazy rules ask which rows of a table a step touched; DP asks for per-sample gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._torch import packs_projections
from .inputs import Call, Captured
from .per_sample import (
    BlockRows,
    IndexedRows,
    Materialized,
    MatrixRows,
    PerSample,
    _batch_of,
    _functional_per_sample_grads,
    forms,
)

__all__ = ["GENERIC", "Layer", "LayerKind", "PerSample", "bias_of", "layer_kind", "register_layer", "weight_of"]

_REGISTRY: dict[type[nn.Module] | str, LayerKind] = {}


def register_layer(*module_types: type[nn.Module] | str) -> Any:
    """Class decorator: register a ``LayerKind`` for ``module_types``, types or qualified names
    (``"transformers.pytorch_utils.Conv1D"``: its package need not be imported). A kind covers
    its types and their subclasses that do not override ``forward``."""

    def register(cls: type[LayerKind]) -> type[LayerKind]:
        kind = cls()
        for module_type in module_types:
            _REGISTRY[module_type] = kind
        _NAMES.clear()  # what a type's weight is called may have changed
        return cls

    return register


def _base(module: nn.Module) -> tuple[type[nn.Module], LayerKind] | None:
    """The nearest registered class in ``module``'s type's MRO, and its kind."""
    for cls in type(module).__mro__:
        kind = _REGISTRY.get(cls) or _REGISTRY.get(f"{cls.__module__}.{cls.__qualname__}")
        if kind is not None:
            return cls, kind
    return None


def _own_forward(module: nn.Module, base: type) -> bool:
    return getattr(type(module), "forward", None) is not getattr(base, "forward", None)


def layer_kind(module: nn.Module) -> LayerKind | None:
    """The ``LayerKind`` of ``module``'s type, or of a registered base whose ``forward`` it keeps;
    ``None`` if there is none or this module's configuration is not supported."""
    found = _base(module)
    if found is None or _own_forward(module, found[0]) or _complex(module):
        return None  # unregistered, a subclass with its own forward (timm's StdConv2d, Conv2dSame), complex
    return found[1] if found[1].supports(module) else None


def _complex(module: nn.Module) -> bool:
    """A complex weight: the kinds' rows and statistics are those of real layers (``xᵀx``, not ``xᴴx``)."""
    weight = _attribute(module, 0)
    return weight is not None and weight.is_complex()


def why_no_kind(module: nn.Module) -> str:
    """Why ``layer_kind(module)`` is ``None``, in words (for coverage reports)."""
    found, name = _base(module), type(module).__name__
    if found is None:
        return f"no LayerKind is registered for {name}"
    if _own_forward(module, found[0]):
        return f"{name} subclasses {found[0].__name__} with its own forward (register a LayerKind for {name})"
    if _complex(module):
        return f"its weight is complex ({weight_of(module).dtype}); the layer kinds handle real weights only"
    return found[1].unsupported(module)


def declared_refusal(module: nn.Module) -> str | None:
    """Why DP refuses ``module``, if its registered kind says so."""
    found = _base(module)
    return found[1].per_sample_refusal if found is not None else None


def explained(module: nn.Module | None, reason: str | None) -> str | None:
    """``reason``, or the registry's own where ``module``'s registered kind declines it."""
    if reason is None or module is None or layer_kind(module) is not None or _base(module) is None:
        return reason
    return why_no_kind(module)


class LayerKind:
    """How one layer type presents its calls and gradients to rules. A capability it lacks raises
    ``NotImplementedError`` (``provides`` tells); ``per_sample_refusal`` says why DP refuses it, if it does."""

    per_sample_refusal: str | None = None
    matrix = True  # whether its weight is a matrix a Kronecker or lazy rule could be expected to cover
    weight_name = "weight"  # the attribute holding the weight matrix W
    bias_name = "bias"  # the attribute holding the bias (its last column in W̃)

    def supports(self, module: nn.Module) -> bool:
        """Whether this particular module (its configuration) is handled."""
        return True

    def unsupported(self, module: nn.Module) -> str:
        """Why this module's configuration is not handled (when ``supports`` is False)."""
        return f"this configuration of {type(module).__name__} is not supported"

    def blocks(self, module: nn.Module) -> int:
        """How many independent blocks ``W̃`` has (a grouped convolution: its ``groups``). With ``k > 1``,
        ``W̃`` is block diagonal and the Kronecker view carries a leading block dimension: rows
        ``(k, samples, in/k [+1])`` and ``(k, samples, out/k)``, ``grad_matrix`` ``(k, out/k, in/k [+1])``."""
        return 1

    def matrix_shape(self, module: nn.Module, homogeneous: bool) -> tuple[int, int]:
        """The shape of ``W̃`` (of one block): ``(out_features, in_features [+1])``."""
        weight = weight_of(module)
        return int(weight.shape[0]) // self.blocks(module), int(weight[0].numel()) + int(homogeneous)

    def provides(self, capability: str) -> bool:
        """Whether this kind implements ``capability`` (a method name of ``LayerKind``)."""
        return getattr(type(self), capability) is not getattr(LayerKind, capability)

    def input_rows(self, module: nn.Module, entry: Captured, homogeneous: bool) -> Tensor:
        """The inputs of every call as rows (float32 or wider): ``(samples, in_features [+1])``."""
        raise NotImplementedError(f"{type(module).__name__} has no input rows")

    def output_grad_rows(self, module: nn.Module, entry: Captured) -> Tensor:
        """The output gradients as rows (float32 or wider) ``(samples, out_features)``, matching ``input_rows``."""
        raise NotImplementedError(f"{type(module).__name__} has no output-gradient rows")

    def batch_size(self, module: nn.Module, entry: Captured) -> int:
        """How many samples the captured calls hold together."""
        raise NotImplementedError(f"{type(module).__name__} has no batch dimension")

    def grad_matrix(self, module: nn.Module, homogeneous: bool) -> Tensor:
        """The gradient of ``W̃``: ``(out_features, in_features [+1])``, bias gradient last."""
        raise NotImplementedError(f"{type(module).__name__} has no weight matrix")

    def set_grad_matrix(self, module: nn.Module, matrix: Tensor, homogeneous: bool) -> None:
        """Write a ``grad_matrix``-shaped tensor back into the weight (and bias) gradients."""
        raise NotImplementedError(f"{type(module).__name__} has no weight matrix")

    def touched_rows(self, module: nn.Module, entry: Captured) -> Tensor:
        """The sorted, unique rows of the weight that the captured calls read (an index tensor)."""
        raise NotImplementedError(f"{type(module).__name__} has no rows to touch")

    def samples(self, module: nn.Module, call: Call) -> int:
        """How many samples one call holds (default: its first tensor argument's leading dimension)."""
        return _batch_of(call)

    def per_sample(self, module: nn.Module, call: Call, names: Sequence[str]) -> PerSample:
        """Each sample's gradient of ``module``'s parameters ``names`` from one call: here ``torch.func``'s
        ``vmap(grad(...))`` over the forward (exact where a sample's output depends on its input alone);
        kinds override it with a closed form."""
        return Materialized(_functional_per_sample_grads(module, call, names))


_NAMES: dict[type, tuple[str, str]] = {}


def _attribute(module: nn.Module, which: int) -> Tensor | None:
    """``module``'s weight (``which=0``) or bias (1), by the names its kind gives (cached per type), if a tensor."""
    names = _NAMES.get(type(module))
    if names is None:
        found = _base(module)
        names = _NAMES[type(module)] = (found[1].weight_name, found[1].bias_name) if found else ("weight", "bias")
    # A registered parameter straight from ``_parameters``: nn.Module.__getattr__ is slower.
    param = module._parameters.get(names[which])
    if param is None:
        param = getattr(module, names[which], None)
    return param if isinstance(param, Tensor) else None


def weight_of(module: nn.Module) -> Tensor:
    """The weight matrix of ``module`` (``module.weight``, or the attribute its kind names)."""
    weight = _attribute(module, 0)
    assert weight is not None, f"{type(module).__name__}.{_NAMES[type(module)][0]} is not a tensor"
    return weight


def weight_or_none(module: nn.Module) -> Tensor | None:
    return _attribute(module, 0)


def bias_of(module: nn.Module) -> Tensor | None:
    """The bias of ``module`` (``module.bias``, or the attribute its kind names), else ``None``."""
    return _attribute(module, 1)


class Layer(NamedTuple):
    """A layer a rule preconditions: its module and kind, whether the bias joins the weight matrix
    (``homogeneous``: it exists and is trained), its weight's param group, and every module owning
    the weight (a shared weight is one layer, with all their calls)."""

    module: nn.Module
    kind: LayerKind
    homogeneous: bool
    group: dict[str, Any]
    owners: tuple[nn.Module, ...] = ()

    def modules(self) -> tuple[nn.Module, ...]:
        """The modules whose calls make up this layer's statistics."""
        return self.owners or (self.module,)


def _statistics_dtype(x: Tensor) -> Tensor:
    """``x`` in float32, or in its own dtype if wider: statistics never accumulate in half precision."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _with_ones(rows: Tensor, homogeneous: bool) -> Tensor:
    """``rows`` with a column of ones appended (the homogeneous coordinate) where ``homogeneous``."""
    return torch.cat([rows, rows.new_ones(*rows.shape[:-1], 1)], dim=-1) if homogeneous else rows


class _WeightMatrix(LayerKind):
    """A kind whose ``W̃`` is its weight (flattened after the first dimension) and bias, in ``blocks`` blocks."""

    transposed = False  # the weight is stored (in, out / blocks, *kernel)

    def matrix_shape(self, module: nn.Module, homogeneous: bool) -> tuple[int, int]:
        if not self.transposed:
            return super().matrix_shape(module, homogeneous)
        shape = weight_of(module).shape
        return int(shape[1]), shape[0] // self.blocks(module) * math.prod(shape[2:]) + int(homogeneous)

    def _weight_grad(self, module: nn.Module, grad: Tensor) -> Tensor:
        """The weight's gradient as ``W̃``'s columns, ``(out, in)``."""
        return grad if grad.dim() == 2 else grad.reshape(grad.shape[0], -1)

    def grad_matrix(self, module: nn.Module, homogeneous: bool) -> Tensor:
        grad, bias = weight_of(module).grad, bias_of(module)
        assert grad is not None
        matrix = self._weight_grad(module, grad)
        if homogeneous:  # the bias gradient as the last column
            assert bias is not None and bias.grad is not None
            matrix = torch.cat((matrix, bias.grad.reshape(-1, 1)), dim=1)
        blocks = self.blocks(module)
        return matrix if blocks == 1 else matrix.reshape(blocks, -1, matrix.shape[1])

    def set_grad_matrix(self, module: nn.Module, matrix: Tensor, homogeneous: bool) -> None:
        # Every step of a Kronecker rule runs this for each layer: direct copies, no reshaping where it can.
        grad, bias = weight_of(module).grad, bias_of(module)
        assert grad is not None
        matrix = matrix.reshape(-1, matrix.shape[-1])
        if homogeneous:
            assert bias is not None and bias.grad is not None
            columns = matrix.shape[1] - 1
            bias.grad.copy_(matrix[:, columns])
            matrix = matrix[:, :columns]
        self._copy_weight_grad(module, grad, matrix)

    def _copy_weight_grad(self, module: nn.Module, grad: Tensor, matrix: Tensor) -> None:
        """Write ``W̃``'s weight columns (``_weight_grad``'s layout) into the weight's gradient."""
        if grad.dim() == 2:
            grad.copy_(matrix)
        elif grad.is_contiguous():
            grad.view(grad.shape[0], -1).copy_(matrix)
        else:  # (a channels-last convolution's gradient)
            grad.copy_(matrix.reshape(grad.shape))


@register_layer(nn.Linear)
class LinearKind(_WeightMatrix):
    """``nn.Linear``: every leading dimension of the input is a sample dimension."""

    def input_rows(self, module: nn.Module, entry: Captured, homogeneous: bool) -> Tensor:
        return _with_ones(_statistics_dtype(entry.rows()), homogeneous)

    def output_grad_rows(self, module: nn.Module, entry: Captured) -> Tensor:
        return _statistics_dtype(entry.grad_output_rows())

    def batch_size(self, module: nn.Module, entry: Captured) -> int:
        return sum(self.samples(module, call) for call in entry.calls)

    def samples(self, module: nn.Module, call: Call) -> int:
        return int(call.input.shape[0]) if call.input.dim() > 1 else 1  # (an unbatched input: one sample)

    def per_sample(self, module: nn.Module, call: Call, names: Sequence[str]) -> PerSample:
        x, g = _statistics_dtype(call.input), _statistics_dtype(_grad_output(call))
        if x.dim() == 1:
            x, g = x[None], g[None]
        positions = math.prod(x.shape[1:-1])  # (not -1: a zero-width layer's rows hold no elements to infer it from)
        x, g = x.reshape(x.shape[0], positions, x.shape[-1]), g.reshape(g.shape[0], positions, g.shape[-1])
        return MatrixRows(x, g, names, weight_of(module).shape, self.transposed)


@register_layer(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvKind(_WeightMatrix):
    """``nn.Conv1d/2d/3d``: a linear map on unfolded input patches, one row per output position (any
    padding mode); a grouped convolution is ``groups`` independent blocks."""

    def blocks(self, module: nn.Module) -> int:
        assert isinstance(module, nn.modules.conv._ConvNd)
        return int(module.groups)

    def _patches(self, module: nn.Module, x: Tensor, call: Call) -> Tensor:
        """``call``'s batched input ``x`` as rows ``(batch, positions, C * prod(kernel))``, channels outermost."""
        assert isinstance(module, nn.modules.conv._ConvNd)
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, conv_padding(module), mode=mode)  # pad as the layer does
        return _windows(x, module.kernel_size, module.stride, module.dilation)

    def _split(self, module: nn.Module, rows: Tensor) -> Tensor:
        """``(..., groups * n)`` -> ``(groups, ..., n)``; unchanged for ``groups=1``."""
        groups = self.blocks(module)
        return rows if groups == 1 else rows.reshape(*rows.shape[:-1], groups, -1).movedim(-2, 0)

    def input_rows(self, module: nn.Module, entry: Captured, homogeneous: bool) -> Tensor:
        dims = weight_of(module).dim()  # a batched input's (B, C, *spatial), as the weight's (out, in, *kernel)
        patches = [
            self._patches(module, _statistics_dtype(_batched(x, dims)), call)
            for x, call in zip(entry.inputs(), entry.calls, strict=True)
        ]
        return _with_ones(self._split(module, torch.cat([r.reshape(-1, r.shape[-1]) for r in patches])), homogeneous)

    def output_grad_rows(self, module: nn.Module, entry: Captured) -> Tensor:
        dims = weight_of(module).dim()
        grads = [_statistics_dtype(_batched(g, dims)) for g in entry.grad_outputs()]
        return self._split(module, torch.cat([g.flatten(2).transpose(1, 2).reshape(-1, g.shape[1]) for g in grads]))

    batch_size = LinearKind.batch_size  # (the samples of every call)

    def samples(self, module: nn.Module, call: Call) -> int:
        return int(call.input.shape[0]) if call.input.dim() == weight_of(module).dim() else 1  # (unbatched: one)

    def per_sample(self, module: nn.Module, call: Call, names: Sequence[str]) -> PerSample:
        groups = self.blocks(module)
        if groups == 1:
            return _conv_rows(module, call, names)
        dims = weight_of(module).dim()
        x = self._patches(module, _statistics_dtype(_batched(call.input, dims)), call)
        g = _statistics_dtype(_batched(_grad_output(call), dims)).flatten(2).transpose(1, 2)
        # (B, T, G * n) -> (B, G, T, n): each group a matrix on its own rows
        x, g = (t.reshape(t.shape[0], t.shape[1], groups, -1).transpose(1, 2) for t in (x, g))
        return BlockRows(x, g, names, weight_of(module).shape)


def _conv_rows(module: nn.Module, call: Call, names: Sequence[str]) -> MatrixRows:
    """An ungrouped convolution call's per-sample gradients: formed where that is the cheaper norm, by
    the weight-gradient kernel run once with the batch as groups; else as rows (im2col by ``F.unfold``,
    channel-major, only viewed position-major; a 3-D convolution's windows, as there is no 3-D unfold)."""
    assert isinstance(module, nn.modules.conv._ConvNd)
    spatial = module.weight.dim() - 2
    x = _statistics_dtype(_batched(call.input, spatial + 2))
    g = _statistics_dtype(_batched(_grad_output(call), spatial + 2))
    padding = [0] * spatial
    if module.padding_mode == "zeros" and isinstance(module.padding, tuple):
        padding = list(module.padding)  # the kernels pad by themselves
    elif any(conv_padding(module)):  # other modes, or "same" (perhaps uneven)
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, conv_padding(module), mode=mode)
    batch, channels, outputs = x.shape[0], x.shape[1], g.shape[1]
    kernel, dilation, stride = module.kernel_size, module.dilation, module.stride
    positions, inputs = math.prod(g.shape[2:]), channels * math.prod(kernel)
    bias_rows = g.flatten(2).sum(2) if "bias" in names else None
    if "weight" in names and forms(positions, inputs, outputs):
        shape = (batch * outputs, channels, *kernel)
        formed = torch.ops.aten.convolution_backward(
            g.reshape(1, batch * outputs, *g.shape[2:]),
            x.reshape(1, batch * channels, *x.shape[2:]),
            g.new_empty(1).expand(shape),
            None, stride, padding, dilation, False, [0] * spatial, batch, (False, True, False),
        )[1]  # fmt: skip
        formed = formed.reshape(batch, outputs, -1)
        return MatrixRows(None, None, names, module.weight.shape, formed=formed, bias_rows=bias_rows)
    if spatial == 3:
        rows = _windows(F.pad(x, [p for p in reversed(padding) for _ in range(2)]), kernel, stride, dilation)
    else:
        if spatial == 1:  # a row of height one
            x, kernel, dilation, stride = x[:, :, None], (1, *kernel), (1, *dilation), (1, *stride)
            padding = [0, *padding]
        rows = F.unfold(x, kernel, dilation=dilation, padding=tuple(padding), stride=stride).transpose(1, 2)
    return MatrixRows(rows, g.flatten(2).transpose(1, 2), names, module.weight.shape, bias_rows=bias_rows)


def _windows(x: Tensor, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int]) -> Tensor:
    """A padded ``(B, C, *spatial)`` input's windows as rows ``(B, positions, C * prod(kernel))``, channels first."""
    spatial, channels = len(kernel), x.shape[1]
    for d, (k, s, dil) in enumerate(zip(kernel, stride, dilation, strict=True)):
        x = x.unfold(2 + d, dil * (k - 1) + 1, s)  # windows along spatial dim d, appended last
        if dil > 1:
            x = x[..., ::dil]
    # (B, C, *out, *kernel) -> (B, *out, C, *kernel)
    x = x.permute([0, *range(2, 2 + spatial), 1, *range(2 + spatial, 2 + 2 * spatial)])
    return x.reshape(x.shape[0], -1, channels * math.prod(kernel))


@register_layer(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
class ConvTransposeKind(ConvKind):
    """``nn.ConvTranspose1d/2d/3d``: the convolution it equals (stride 1, over its input with ``stride - 1``
    zeros inserted and ``dilation * (kernel - 1) - padding`` padded each side, plus ``output_padding``),
    with the weight ``W'[o, c] = flip(W[c, o])`` per group. Per-sample gradients go through ``torch.func``."""

    transposed = True

    def _patches(self, module: nn.Module, x: Tensor, call: Call) -> Tensor:
        assert isinstance(module, nn.modules.conv._ConvTransposeNd)
        spatial, sizes = len(module.kernel_size), x.shape[2:]
        up = x.new_zeros(*x.shape[:2], *[(n - 1) * s + 1 for n, s in zip(sizes, module.stride, strict=True)])
        every_stride = (slice(None), slice(None), *[slice(None, None, s) for s in module.stride])
        up[every_stride] = x
        output_size = call.args[1] if len(call.args) > 1 else call.kwargs.get("output_size")
        pads: list[int] = []
        for d in reversed(range(spatial)):  # F.pad lists the last dimension first
            k, s, p, dil = module.kernel_size[d], module.stride[d], int(module.padding[d]), module.dilation[d]
            extra = module.output_padding[d]
            if output_size is not None:  # the call chose its output size: that is its output padding
                extra = int(output_size[-spatial + d]) - ((sizes[d] - 1) * s - 2 * p + dil * (k - 1) + 1)
            pads += [dil * (k - 1) - p, dil * (k - 1) - p + extra]
        up = F.pad(up, pads)  # negative padding crops
        return _windows(up, module.kernel_size, [1] * spatial, module.dilation)

    per_sample = LayerKind.per_sample  # torch.func's, exact (no closed form here yet)

    def _weight_grad(self, module: nn.Module, grad: Tensor) -> Tensor:
        # W (C_in, C_out / g, *k) -> the equivalent convolution's W' (C_out, C_in / g, *k), flattened
        assert isinstance(module, nn.modules.conv._ConvTransposeNd)
        w = grad.reshape(self.blocks(module), -1, *grad.shape[1:]).transpose(1, 2)
        w = w.flip(list(range(3, 3 + len(module.kernel_size))))
        return w.reshape(module.out_channels, -1)

    def _copy_weight_grad(self, module: nn.Module, grad: Tensor, matrix: Tensor) -> None:
        assert isinstance(module, nn.modules.conv._ConvTransposeNd)
        groups = self.blocks(module)
        w = matrix.reshape(groups, module.out_channels // groups, grad.shape[0] // groups, *grad.shape[2:])
        w = w.flip(list(range(3, 3 + len(module.kernel_size)))).transpose(1, 2)
        grad.copy_(w.reshape(grad.shape))


@register_layer(nn.MultiheadAttention)
class MultiheadAttentionKind(_WeightMatrix):
    """``nn.MultiheadAttention``'s ``in_proj_weight`` (``3E x E``): three blocks, the query, key and value
    projections, each on rows of its own input. Only the input side is known (the projections' outputs
    stay inside the call); blocks with fewer rows (cross-attention) are scaled and zero-padded."""

    weight_name, bias_name = "in_proj_weight", "in_proj_bias"
    per_sample_refusal = (
        "its out_proj.weight is used without calling out_proj, so no captured call carries its per-sample "
        "gradient. Use opacus.layers.DPMultiheadAttention (a drop-in built from linear layers, exact here), or "
        "build the attention from nn.Linear projections (as Hugging Face models do)"
    )

    def supports(self, module: nn.Module) -> bool:
        return isinstance(module, nn.MultiheadAttention) and packs_projections(module)

    def unsupported(self, module: nn.Module) -> str:
        return (
            "MultiheadAttention with kdim or vdim other than embed_dim keeps separate q/k/v_proj_weight; no "
            "Kronecker form is implemented for them"
        )

    def blocks(self, module: nn.Module) -> int:
        return 3

    def input_rows(self, module: nn.Module, entry: Captured, homogeneous: bool) -> Tensor:
        per_call = []
        for call in entry.calls:
            inputs = [*call.args[:3], *(call.kwargs[n] for n in ("query", "key", "value")[len(call.args) :])]
            rows = [_with_ones(_statistics_dtype(x.reshape(-1, x.shape[-1])), homogeneous) for x in inputs]
            width = max(r.shape[0] for r in rows)
            rows = [  # scaled so that (1 / width) sum x xᵀ is the mean over its own rows
                r
                if r.shape[0] == width
                else torch.cat([r * math.sqrt(width / max(r.shape[0], 1)), r.new_zeros(width - r.shape[0], r.shape[1])])
                for r in rows
            ]
            per_call.append(torch.stack(rows))
        return torch.cat(per_call, dim=1)


@register_layer(nn.modules.linear.NonDynamicallyQuantizableLinear)
class AttentionOutputKind(LayerKind):
    """``nn.MultiheadAttention.out_proj``, whose weight is used without calling it (not a covered ``nn.Linear``)."""

    per_sample_refusal = MultiheadAttentionKind.per_sample_refusal

    def supports(self, module: nn.Module) -> bool:
        return False

    def unsupported(self, module: nn.Module) -> str:
        return (
            "nn.MultiheadAttention uses out_proj.weight without calling out_proj, so its inputs are never "
            "captured. Build the attention from nn.Linear projections (as Hugging Face models do) to cover it"
        )


@register_layer("transformers.pytorch_utils.Conv1D")
class TransposedLinearKind(LinearKind):
    """Hugging Face's ``Conv1D`` (GPT-2): ``y = x W + b``, a ``nn.Linear`` with its weight stored ``(in, out)``."""

    transposed = True

    def _weight_grad(self, module: nn.Module, grad: Tensor) -> Tensor:
        return grad.T

    def _copy_weight_grad(self, module: nn.Module, grad: Tensor, matrix: Tensor) -> None:
        grad.copy_(matrix.T)


def _grad_output(call: Call) -> Tensor:
    grad = call.grad_output
    if grad is None:
        raise RuntimeError(f"no output gradient was captured for {call!r}")
    return grad


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

    def per_sample(self, module: nn.Module, call: Call, names: Sequence[str]) -> PerSample:
        index, g = call.input, _statistics_dtype(_grad_output(call))
        if index.dim() == 1:  # one index per sample
            index, g = index[:, None], g[:, None]
        padding = getattr(module, "padding_idx", None)
        if padding is not None:
            index = index.masked_fill(index == padding, -1)
        index = index.reshape(index.shape[0], -1)
        return IndexedRows(index, g.reshape(index.shape[0], -1, g.shape[-1]), weight_of(module).shape[0])


@register_layer(nn.EmbeddingBag)
class EmbeddingBagKind(EmbeddingKind):
    """``nn.EmbeddingBag``: each bag is a sample, adding ``w_j g`` to the row of each index ``j`` it holds
    (``w_j`` its ``per_sample_weights``, else 1; ``/ n`` under ``mode="mean"``); ``"max"`` goes through
    ``torch.func`` (2-d input only)."""

    def samples(self, module: nn.Module, call: Call) -> int:
        index, offsets, _ = _bag_arguments(call)
        if index.dim() == 2 or offsets is None:
            return int(index.shape[0])
        return len(offsets) - int(getattr(module, "include_last_offset", False))

    def per_sample(self, module: nn.Module, call: Call, names: Sequence[str]) -> PerSample:
        assert isinstance(module, nn.EmbeddingBag)
        index, offsets, weights = _bag_arguments(call)
        if module.mode == "max":
            if offsets is not None:
                raise RuntimeError(
                    f"per-sample gradients of {call!r} (mode='max' with offsets) are not supported: pass the bags "
                    "as a 2-d input of equal-length bags, or use mode='sum' or 'mean'"
                )
            return LayerKind.per_sample(self, module, call, names)
        g = _statistics_dtype(_grad_output(call))
        if index.dim() == 2:  # equal-length bags, one per row
            bags = index
            scale = weights.to(g) if weights is not None else g.new_ones(bags.shape)
        else:
            assert offsets is not None
            if not module.include_last_offset:
                offsets = torch.cat([offsets, offsets.new_tensor([index.numel()])])
            starts, ends = offsets[:-1], offsets[1:]
            lengths = ends - starts
            bag = torch.repeat_interleave(torch.arange(len(starts), device=index.device), lengths)
            position = torch.arange(index.numel(), device=index.device) - starts[bag]
            width = int(lengths.max()) if len(lengths) else 0
            bags = index.new_full((len(starts), width), -1)
            bags[bag, position] = index
            scale = g.new_zeros(bags.shape)
            scale[bag, position] = weights.to(g) if weights is not None else 1.0
        kept = bags >= 0
        if module.padding_idx is not None:
            kept &= bags != module.padding_idx
        bags = bags.masked_fill(~kept, -1)
        scale = scale * kept
        if module.mode == "mean":
            scale = scale / kept.sum(1, keepdim=True).clamp(min=1)
        return IndexedRows(bags, g[:, None, :] * scale[..., None], weight_of(module).shape[0])


def _bag_arguments(call: Call) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(input, offsets, per_sample_weights)`` of an ``nn.EmbeddingBag`` call, positional or keyword."""
    args = list(call.args) + [None] * (3 - len(call.args))
    offsets = args[1] if args[1] is not None else call.kwargs.get("offsets")
    weights = args[2] if args[2] is not None else call.kwargs.get("per_sample_weights")
    return args[0] if args[0] is not None else call.kwargs["input"], offsets, weights


@register_layer(nn.LayerNorm)
class LayerNormKind(LayerKind):
    """``nn.LayerNorm``: no weight matrix (its scale and shift are per feature), a closed-form per-sample gradient."""

    matrix = False

    def per_sample(self, module: nn.Module, call: Call, names: Sequence[str]) -> PerSample:
        """Weight ``sum_t g_bt * x̂_bt`` (``x̂``: the input normalized, without the affine part), bias ``sum_t g_bt``,
        over the positions ``t`` before the normalized dimensions."""
        assert isinstance(module, nn.LayerNorm)
        shape = tuple(module.normalized_shape)
        x, g = _statistics_dtype(call.input), _statistics_dtype(_grad_output(call))
        if x.dim() == len(shape):  # one sample, unbatched
            x, g = x[None], g[None]
        grads = {}
        if "weight" in names:
            grads["weight"] = (g * F.layer_norm(x, shape, None, None, module.eps)).reshape(len(x), -1, *shape).sum(1)
        if "bias" in names:
            grads["bias"] = g.reshape(len(x), -1, *shape).sum(1)
        return Materialized(grads)


GENERIC = LayerKind()
"""The kind of any module without a registered one: only the generic per-sample capabilities."""


def conv_padding(module: nn.Module) -> tuple[int, ...]:
    """The padding a convolution applies, in ``F.pad``'s order (``"same"``: the extra on the after side)."""
    assert isinstance(module, nn.modules.conv._ConvNd)
    spatial = len(module.kernel_size)
    if module.padding == "valid":
        return (0,) * (2 * spatial)
    if module.padding == "same":
        pads: list[int] = []
        for dilation, kernel in zip(reversed(module.dilation), reversed(module.kernel_size), strict=True):
            total = dilation * (kernel - 1)
            pads += [total // 2, total - total // 2]
        return tuple(pads)
    return tuple(int(p) for p in reversed(tuple(module.padding)) for _ in range(2))  # type: ignore[call-overload]
