"""The benchmark sections, in report order.

A section is a module that defines ``SECTION`` (a ``benchmarks.core.Section``); adding one
is that module plus its line in ``SECTIONS``.
"""

from __future__ import annotations

from ..core import Section
from . import (
    capture_overhead,
    convergence,
    distributed,
    dp,
    foof,
    gpt,
    grad_outputs,
    hook_cost,
    inversion,
    kfac,
    lazy_adamw,
    memory,
    monitor,
    nlms,
    tokens,
)

SECTIONS: list[Section] = [
    gpt.SECTION,
    tokens.SECTION,
    hook_cost.SECTION,
    capture_overhead.SECTION,
    memory.SECTION,
    foof.SECTION,
    nlms.SECTION,
    lazy_adamw.SECTION,
    grad_outputs.SECTION,
    kfac.SECTION,
    convergence.SECTION,
    inversion.SECTION,
    dp.SECTION,
    distributed.SECTION,
    monitor.SECTION,
]
