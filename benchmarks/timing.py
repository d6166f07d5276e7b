"""Interleaved timing: every figure is a ratio against a baseline timed in the same process.

The variants run in turn, ``A B B A A B ...`` (``A B C C B A ...`` for more than two: the order
reverses every round, so no variant always runs first after a switch), each sample repeating
one variant's call until it lasts at least ``sample_seconds``. A round
gives one ratio per variant against the baseline; the figure is the median over rounds,
with the minimum and maximum. Drift in the machine's speed (another process, frequency
scaling) then moves both sides of a ratio together instead of biasing it.
"""

from __future__ import annotations

import math
import resource
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from .core import Config, format_ratio

__all__ = ["Ratio", "Timing", "interleave"]


@dataclass
class Ratio:
    """The median of per-round values (ratios or differences), with their range."""

    median: float
    low: float
    high: float
    rounds: list[float]

    @classmethod
    def of(cls, values: list[float]) -> Ratio:
        return cls(statistics.median(values), min(values), max(values), values)

    def shown(self) -> str:
        return format_ratio(self.median, self.low, self.high)


@dataclass
class Timing:
    """Per-call seconds of each variant, one sample per round.

    Attributes:
        calls: How many calls each sample of a variant made.
        seconds: Per-call seconds of each variant, one value per round.
        page_faults: Per-call minor page faults of the process during each sample (memory the
            allocator took back from the kernel and had to fault in again), one value per round.
        threads: ``torch.get_num_threads()`` while timing.
    """

    calls: dict[str, int]
    seconds: dict[str, list[float]]
    page_faults: dict[str, list[float]]
    threads: int

    def ratio(self, candidate: str, baseline: str) -> Ratio:
        """``candidate / baseline`` per round."""
        return Ratio.of([c / b for c, b in zip(self.seconds[candidate], self.seconds[baseline], strict=True)])

    def difference(self, candidate: str, baseline: str) -> Ratio:
        """``candidate - baseline`` per call, in seconds, per round."""
        return Ratio.of([c - b for c, b in zip(self.seconds[candidate], self.seconds[baseline], strict=True)])

    def per_call(self, name: str) -> float:
        """Median per-call seconds of a variant (an absolute figure: for scale, not comparison)."""
        return statistics.median(self.seconds[name])

    def faults_per_call(self, name: str) -> float:
        """Median minor page faults per call of a variant."""
        return statistics.median(self.page_faults[name])

    def to_json(self) -> dict[str, object]:
        return {"calls": self.calls, "seconds": self.seconds, "page_faults": self.page_faults, "threads": self.threads}


def interleave(
    variants: Mapping[str, Callable[[], object]],
    config: Config,
    *,
    multiple_of: Mapping[str, int] | None = None,
    before_sample: Mapping[str, Callable[[], object]] | None = None,
) -> Timing:
    """Time each variant in turn, ``config.pairs`` rounds after warm-up.

    Args:
        variants: The calls to time, by name; the first is conventionally the baseline.
        config: Supplies ``pairs``, ``sample_seconds`` and ``warmup_seconds``.
        multiple_of: Round a variant's calls per sample up to a multiple of this (for a call
            whose cost varies with a period, such as an inverse refreshed every k steps).
        before_sample: An untimed call before each sample of a variant (setting up its inputs).
    """
    multiple_of = multiple_of or {}
    before_sample = before_sample or {}
    calls: dict[str, int] = {}
    for name, call in variants.items():
        if name in before_sample:
            before_sample[name]()
        calls[name] = _calibrate(call, config.warmup_seconds, config.sample_seconds, multiple_of.get(name, 1))
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    faults: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants.items())
    for round_ in range(config.pairs):
        # A B, then B A: whichever runs first after a switch pays for the switch (caches, the
        # allocator), so alternating the order keeps that cost out of the ratios.
        for name, call in order if round_ % 2 == 0 else order[::-1]:
            if name in before_sample:
                before_sample[name]()
            before = _minor_faults()
            seconds[name].append(_sample(call, calls[name]) / calls[name])
            faults[name].append((_minor_faults() - before) / calls[name])
    return Timing(calls, seconds, faults, torch.get_num_threads())


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _sample(call: Callable[[], object], count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        call()
    return time.perf_counter() - start


def _calibrate(call: Callable[[], object], warmup_seconds: float, sample_seconds: float, multiple: int) -> int:
    """Warm ``call`` up and return how many calls make a sample of ``sample_seconds``."""
    count, start = 0, time.perf_counter()
    while count < 2 or time.perf_counter() - start < warmup_seconds:
        call()
        count += 1
    trial = 1
    while (elapsed := _sample(call, trial)) < sample_seconds / 5:
        trial *= 2
    needed = max(1, math.ceil(trial * sample_seconds / elapsed))
    return math.ceil(needed / multiple) * multiple
