"""NLMS: normalized least mean squares, the input-normalized gradient step."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor, nn

from .coverage import layer_treatment
from .distributed import ParallelLayout, all_reduce_sum_, local_call, local_tensor, tensor_parallel_style
from .inputs import Call, Captured, Inputs
from .kronecker import FactorSums, Sums, summed_over_ranks, tensor_parallel_problem, zero_sums
from .layers import Layer, LinearKind, bias_of, weight_of
from .reduction import Reduction
from .rule import Rule
from .sgd import SGDWithRule

__all__ = ["NLMS", "InputNormalization"]

_EPS_RENAMED = (
    "NLMS's eps was renamed damping (it is added to the input power, as the other rules add their damping before "
    "inverting; eps is a base optimizer's own, as AdamW's with base=torch.optim.AdamW)"
)


class InputPower(FactorSums):
    """Per call, in the forward hook: the sum of ``‖x̃‖²`` over its input rows, and their number (not for a layer
    of width 0, which has nothing to normalize: as for the Kronecker factors, its step is the stock one)."""

    def __init__(self, layers: list[Layer], split_features: dict[nn.Module, Any] | None = None) -> None:
        super().__init__(layers)
        # Layers whose input features tensor parallelism splits (RowwiseParallel), with the group they are split
        # over: each rank's power is of its features only, without the bias's 1 (summed over the group at the step).
        self.split_features = split_features or {}

    @staticmethod
    def side(rows: Tensor) -> Tensor:
        # One power per block of a grouped convolution (each filter sees only its group's inputs).
        return rows.pow(2).sum((-2, -1))

    def forward(self, call: Call) -> Any:
        layer = self.layers[call.module]
        homogeneous = layer.homogeneous and call.module not in self.split_features
        rows = layer.kind.input_rows(call.module, Captured([local_call(call)]), homogeneous)
        return {"input": (self.side(rows), float(rows.shape[-2]))}  # (a count known here: no device read)


class InputNormalization(Rule):
    r"""NLMS's transform of the gradients: each layer's weight and bias gradient divided by
    :math:`\lambda + \frac1N\sum_n \lVert \tilde x_n\rVert^2` (``NLMS``'s docstring has the rule). Chain it in
    front of any stock optimizer.

    Args:
        damping: :math:`\lambda` (>= 0), added to the input power.
    """

    layers = "input_rows"

    def __init__(self, damping: float = 1e-6) -> None:
        self.defaults = {"damping": damping}
        self.check_group(self.defaults)
        self._power: InputPower | None = None

    @property
    def reads(self) -> list[Reduction]:  # type: ignore[override]
        return [] if self._power is None else [self._power]

    def setup(self, optimizer: Any) -> None:
        layout = ParallelLayout(optimizer.model)
        if any(len(layout.data_dims(p)) > 1 for p in optimizer._params()):
            # HSDP: the input power would be averaged over one of its mesh dimensions only
            raise NotImplementedError(
                "NLMS supports FSDP2 over a 1-D mesh only (got a 2-D mesh, as HSDP uses): the input power "
                "must be averaged over every data-parallel rank. Shard over a 1-D mesh, or use DistributedDataParallel"
            )
        layers = optimizer.layers("input_rows")
        self._power = InputPower(layers, self._split_features(optimizer, layout, layers))

    @staticmethod
    def _split_features(optimizer: Any, layout: ParallelLayout, layers: list[Layer]) -> dict[nn.Module, Any]:
        """The layers tensor parallelism splits on their input features, with the group it splits them over;
        a layer split otherwise that the input power cannot follow is refused by name."""
        split = {}
        for layer in layers:
            weight, bias = weight_of(layer.module), bias_of(layer.module) if layer.homogeneous else None
            style = tensor_parallel_style(layout, weight, bias)
            if style is None or (style == "columns" and type(layer.kind) is LinearKind):
                continue  # (column-sharded: each rank sees the whole input, so its power is the whole power)
            if style == "rows" and type(layer.kind) is LinearKind:
                split[layer.module] = layout.tensor_group(weight)
                continue
            raise NotImplementedError(
                f"NLMS cannot normalize {optimizer.capture.name(layer.module)} under tensor parallelism: "
                f"{tensor_parallel_problem(style, layer.module, layer.kind)}. Parallelize it with ColwiseParallel "
                "or RowwiseParallel, or leave it out of the optimizer's params"
            )
        return split

    def check_group(self, group: dict[str, Any]) -> None:
        if not 0.0 <= group["damping"] < math.inf:
            raise ValueError(f"Invalid damping: {group['damping']} (must be finite and >= 0)")

    def treatment(self, optimizer: Any, param: torch.Tensor, module: nn.Module | None) -> tuple[str, str | None, bool]:
        return layer_treatment(optimizer, param, module, "input_rows", "NLMS: input-normalized")

    def update(self, optimizer: Any, inputs: Inputs) -> None:
        """Divide the gradients of every layer with input rows by its input power."""
        assert self._power is not None
        layers = [
            layer
            for layer in optimizer.layers("input_rows")
            if (weight := weight_of(layer.module)).grad is not None and weight.numel() > 0  # (width 0: the stock step)
        ]
        zeros = functools.partial(zero_sums, shapes={"input": ()})  # (one power per block)
        group = optimizer.data_parallel_group
        layers, sums = summed_over_ranks(inputs, inputs.reduced(self._power), layers, zeros, group)
        sums = self._summed_over_features(layers, sums)
        for layer, layer_sums in zip(layers, sums, strict=True):
            power, count = layer_sums["input"]
            scale = 1.0 / (layer.group["damping"] + power / count)
            for param in (weight_of(layer.module), bias_of(layer.module) if layer.homogeneous else None):
                if param is not None and param.grad is not None:
                    grad = local_tensor(param.grad)
                    if scale.dim():  # per block: the output channels of each group
                        grad.view(scale.numel(), -1).mul_(scale[:, None].to(grad.dtype))
                    else:
                        grad.mul_(scale.to(grad.dtype))

    def _summed_over_features(self, layers: list[Layer], sums: list[Sums]) -> list[Sums]:
        """The sums of a layer whose input features tensor parallelism splits, its ranks' powers added (one
        all-reduce per group) and the bias's 1 counted once per row; the others as they are."""
        assert self._power is not None
        split = self._power.split_features
        out = list(sums)
        groups: dict[Any, list[int]] = {}
        for index, layer in enumerate(layers):
            if layer.module in split:
                power, count = out[index]["input"]
                out[index] = {"input": (power.clone(), count)}  # (the capture keeps its totals for a retry)
                groups.setdefault(split[layer.module], []).append(index)
        for group, indices in groups.items():
            all_reduce_sum_([out[i]["input"][0] for i in indices], group)
            for i in indices:
                if layers[i].homogeneous:
                    power, count = out[i]["input"]
                    out[i] = {"input": (power + count, count)}
        return out


class NLMS(SGDWithRule):
    r"""Normalized least mean squares: each layer's step divided by its input power.

    For the weight and bias gradients of each layer with input rows (``nn.Linear``, Hugging Face's
    ``Conv1D``, convolutions through their patches; a grouped convolution per group), with
    :math:`\tilde x` the input with a 1 appended when the bias is trained, and :math:`N` the rows
    of every call of the step (and of every data-parallel rank):

    .. math::
        g \leftarrow \frac{g}{\lambda + \frac{1}{N}\sum_{n=1}^{N} \lVert \tilde x_n \rVert^2}

    then the SGD update. For one sample and loss :math:`\tfrac12 e^2` this is the textbook
    :math:`w \leftarrow w + \mu\, e\, x / (\lambda + \lVert x\rVert^2)`. Other parameters take plain SGD.

    Args:
        model: The model.
        lr: Learning rate :math:`\mu` (stable for :math:`0 < \mu < 2` on least squares).
        damping: :math:`\lambda` (>= 0), added to the input power (the textbook's :math:`\varepsilon`; named
            as the other rules name what they add before inverting, and apart from a base's ``eps``).
        params: Parameters or param groups of ``model`` (default: all that require grad).
        **sgd_kwargs: Any other ``torch.optim.SGD`` argument (``momentum``, ``weight_decay``, ...),
            ``storage``, or ``base=`` (a stock optimizer class to take the update instead of SGD) and
            its arguments (``eps`` is the base's).

    Reference:
        Simon Haykin, "Adaptive Filter Theory", chapter on normalized LMS.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float | None = None,
        damping: float = 1e-6,
        *,
        params: Any = None,
        **sgd_kwargs: Any,
    ) -> None:
        if "eps" in sgd_kwargs and sgd_kwargs.get("base") is None:
            raise TypeError(_EPS_RENAMED)
        wanted = "layer with input rows (nn.Linear, nn.Conv1d/2d/3d, ...)"
        self._construct(model, lr, None, InputNormalization(damping), params, sgd_kwargs, wanted, None)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, as ``torch.optim.Optimizer.add_param_group`` does.

        Raises:
            TypeError: If the group sets ``eps`` and the update has none (NLMS's is ``damping``), as the
                constructor refuses it: the group would keep it and normalize by the default damping.
        """
        if isinstance(param_group, dict) and "eps" in param_group and "eps" not in self.defaults:
            raise TypeError(f"{_EPS_RENAMED}: give the group 'damping' instead of 'eps'. No group was added")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.__dict__.get("_base") is None:  # a checkpoint from before the rename: its eps is damping
            groups = [
                {**{k: v for k, v in g.items() if k != "eps"}, "damping": g.get("damping", g["eps"])}
                if "eps" in g
                else g
                for g in state_dict.get("param_groups", ())
            ]
            state_dict = {**state_dict, "param_groups": groups}
        super().load_state_dict(state_dict)
