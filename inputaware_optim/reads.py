"""What an input-aware optimizer's readers read, and the capture kept in step with it: the modules its rules (and
a subclass's ``step`` override) read, whether they want output gradients, and the reductions its rules read at
the coming step."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from torch import Tensor, nn

from .capture import unwrap_model
from .layers import layer_kind

if TYPE_CHECKING:
    from .base import InputAwareOptimizer

__all__ = ["capabilities", "grad_outputs", "modules_to_capture", "override_reads", "sync_reads"]

Scope = tuple[tuple[type[nn.Module], ...] | None, str | None]  # (module types, registry capability)


def override_reads(optimizer: InputAwareOptimizer) -> bool:
    """Whether a subclass's ``step`` override reads the capture (what its class attributes declare)."""
    declared = optimizer.reads_calls
    if declared is None:
        return optimizer._overrides_step()
    return bool(declared) or optimizer.reads_capability is not None


def grad_outputs(optimizer: InputAwareOptimizer) -> bool:
    """Whether a reader wants each raw call's output gradients."""
    return type(optimizer).grad_outputs or any(rule.grad_outputs for rule in optimizer.rules)


def capabilities(optimizer: InputAwareOptimizer) -> list[str]:
    """The registry capabilities the readers act on (each rule's ``layers``, an override's ``reads_capability``)."""
    found = [rule.layers for rule in optimizer.rules if rule.layers is not None]
    if optimizer.reads_capability is not None:
        found.append(optimizer.reads_capability)
    return list(dict.fromkeys(found))


def _scopes(optimizer: InputAwareOptimizer) -> list[Scope]:
    """``(module types, capability)`` of each reader: the subclass's declarations if it reads, each rule's."""
    scopes: list[Scope] = []
    if override_reads(optimizer):
        scopes.append((optimizer.captured_module_types, optimizer.reads_capability))
    for rule in optimizer.rules:  # (reads declared as a property: what it reads is built in setup, from these)
        if rule.reads_calls or rule.read_reductions() or rule.layers is not None or type(rule).reads is not None:
            scopes.append((None, rule.layers))
    return scopes or [(None, None)]  # (nothing reads: every owner, hooked once a hook reads them)


def modules_to_capture(optimizer: InputAwareOptimizer, params: Iterable[Tensor]) -> list[nn.Module]:
    """The modules of the model that own one of ``params`` and that some reader's scope takes."""
    wanted = {id(p) for p in params}
    scopes = _scopes(optimizer)
    return [
        module
        for module in unwrap_model(optimizer.model).modules()
        if any(id(p) in wanted for p in module._parameters.values() if p is not None)
        and any(
            (types is None or isinstance(module, types))
            and (capability is None or ((kind := layer_kind(module)) is not None and kind.provides(capability)))
            for types, capability in scopes
        )
    ]


def sync_reads(optimizer: InputAwareOptimizer) -> None:
    """Put in the capture the reductions the rules read at the coming step, and take out those they stopped
    reading (its hooks kept: a rule that pauses between statistics steps does not retrace a compiled model)."""
    if not optimizer.rules:
        return
    held = optimizer._reductions
    wanted = dict.fromkeys(r for rule in optimizer.rules for r in rule.read_reductions())
    if wanted.keys() == held.keys():
        return
    capture = optimizer.capture
    for reduction in [r for r in held if r not in wanted]:
        capture.remove_reduction(reduction, keep_hooks=True)
    new = [r for r in wanted if r not in held]
    if new:  # the modules they read that the capture does not watch yet (a router keying its gate's weight)
        trained, watched = {id(p) for p in optimizer._params()}, set(capture.modules)
        below = [
            m
            for m in capture.root.modules()
            if m not in watched and any(r.wants(m) and any(id(p) in trained for p in r.keys(m)) for r in new)
        ]
        if below:
            capture.add_modules(below)
    for reduction in wanted:
        capture.add_reduction(reduction)
    optimizer._reductions = wanted
