"""PrivacyAccountant: the privacy a DP optimizer's steps spent, as Opacus's accountants compute it from the
history of noise multipliers and sampling rates (``epsilon``)."""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["PrivacyAccountant"]

ACCOUNTANTS = ("prv", "rdp", "gdp")  # Opacus's


class PrivacyAccountant:
    """The steps a DP optimizer took, as ``(noise_multiplier, sample_rate, steps)`` per run of steps at the same
    pair (Opacus's ``history``), and the :math:`\\varepsilon` they spent (``epsilon``)."""

    def __init__(self, owner: str = "DPSGD") -> None:
        self.owner = owner  # the optimizer's class name, for messages
        self.history: list[tuple[float, float | None, int]] = []

    def record(self, noise_multiplier: float, sample_rate: float | None) -> None:
        """One step at ``noise_multiplier`` and ``sample_rate``."""
        history = self.history
        if history and history[-1][:2] == (noise_multiplier, sample_rate):
            history[-1] = (noise_multiplier, sample_rate, history[-1][2] + 1)
        else:
            history.append((noise_multiplier, sample_rate, 1))

    def epsilon(self, delta: float, accountant: str = "prv", sample_rate: float | None = None) -> float:
        r"""The :math:`\varepsilon` spent so far for ``delta``, by Opacus's accountant over the history.

        Args:
            delta: The target :math:`\delta` (in (0, 1)).
            accountant: Opacus's ``"prv"`` (its default), ``"rdp"`` or ``"gdp"`` (one noise multiplier only).
            sample_rate: The rate the optimizer is set to now (asked for when no step recorded one).

        Raises:
            ValueError: If no sampling rate is known, or ``"gdp"`` is asked of a changing noise.
            ImportError: If ``opacus`` is not installed.
        """
        name = self.owner
        if all(rate is None for _, rate, _ in self.history) and sample_rate is None:
            raise ValueError(
                f"{name}.epsilon needs the sampling rate: construct it with "
                "sample_rate=<batch size / dataset size> (the probability of a sample being in a batch)"
            )
        if not 0.0 < delta < 1.0:
            raise ValueError(f"Invalid delta: {delta!r} (must be in (0, 1))")
        create_accountant = _opacus_accountants()
        history = self.history
        if not history:
            return 0.0
        if any(sigma == 0.0 for sigma, _, _ in history):
            return math.inf
        if any(rate is None for _, rate, _ in history):
            raise ValueError(
                f"{name}.epsilon: some steps were taken without a sampling rate (a state dict saved "
                "by an optimizer constructed without sample_rate); their privacy cost is unknown"
            )
        if accountant == "gdp" and len(history) > 1:
            raise ValueError(
                f"{name}.epsilon: Opacus's 'gdp' accountant composes one noise multiplier and sampling "
                f"rate only, and these steps took {len(history)} (see privacy_history); use 'prv' or 'rdp'"
            )
        counter = create_accountant(mechanism=accountant)
        counter.history = list(history)
        return float(counter.get_epsilon(delta=delta))

    @staticmethod
    def noise_multiplier_for(
        *,
        epsilon: float,
        delta: float,
        sample_rate: float,
        steps: int | None = None,
        epochs: float | None = None,
        accountant: str = "prv",
        epsilon_tolerance: float = 0.01,
    ) -> float:
        r"""The noise multiplier whose ``steps`` (or ``epochs``) at ``sample_rate`` spend :math:`\varepsilon` at most
        ``epsilon`` for ``delta``, by Opacus's ``get_noise_multiplier`` (the smallest it finds, to
        ``epsilon_tolerance``), called with these arguments: its ``target_epsilon``, ``target_delta``,
        ``sample_rate``, ``steps`` or ``epochs`` (``int(epochs / sample_rate)`` steps), ``accountant``. The DP
        optimizers have it as ``DPSGD.noise_multiplier_for`` / ``DPAdamW.noise_multiplier_for``: pass the result as
        their ``noise_multiplier=``, with ``sample_rate=``; their ``epsilon(delta, accountant)`` then reports the
        budget spent (under adaptive clipping it is the noise multiplier accounted, as ``noise_multiplier`` is).

        Args:
            epsilon: The target :math:`\varepsilon` (> 0).
            delta: The target :math:`\delta` (in (0, 1)).
            sample_rate: Each sample's probability of being in a batch (in (0, 1]).
            steps: The steps of the run; or
            epochs: its epochs (exactly one of the two).
            accountant: Opacus's ``"prv"`` (its ``PrivacyEngine``'s default, and ``epsilon``'s), ``"rdp"`` or ``"gdp"``.
            epsilon_tolerance: How far below ``epsilon`` the search may stop.

        Raises:
            ValueError: If an argument is out of range, or no noise multiplier up to 1e6 meets the budget.
            ImportError: If ``opacus`` is not installed.
        """
        _check_target(epsilon, delta, sample_rate, steps, epochs, accountant, epsilon_tolerance)
        try:
            from opacus.accountants.utils import get_noise_multiplier
        except ImportError:
            _opacus_accountants()  # (raises, saying how to install it)
            raise
        return float(
            get_noise_multiplier(
                target_epsilon=epsilon,
                target_delta=delta,
                sample_rate=sample_rate,
                steps=steps,
                epochs=epochs,
                accountant=accountant,
                epsilon_tolerance=epsilon_tolerance,
            )
        )

    def state_dict(self) -> list[list[Any]]:
        return [list(entry) for entry in self.history]

    def load_state_dict(self, history: list[Any]) -> None:
        self.history = [
            (float(sigma), None if rate is None else float(rate), int(steps)) for sigma, rate, steps in history
        ]


def _opacus_accountants() -> Any:
    try:
        from opacus.accountants import create_accountant
    except ImportError as error:
        raise ImportError(
            "privacy accounting uses Opacus's accountants: pip install opacus (or the 'privacy' extra: "
            "pip install 'inputaware_optim[privacy]')"
        ) from error
    return create_accountant


def _check_target(
    epsilon: Any, delta: Any, sample_rate: Any, steps: Any, epochs: Any, accountant: Any, tolerance: Any
) -> None:
    def real(value: Any) -> bool:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)

    if not (real(epsilon) and epsilon > 0):
        raise ValueError(f"Invalid epsilon: {epsilon!r} (must be a finite number > 0)")
    if not (real(delta) and 0 < delta < 1):
        raise ValueError(f"Invalid delta: {delta!r} (must be in (0, 1))")
    if not (real(sample_rate) and 0 < sample_rate <= 1):
        raise ValueError(f"Invalid sample_rate: {sample_rate!r} (must be in (0, 1])")
    if (steps is None) == (epochs is None):
        raise ValueError(f"Give steps or epochs, exactly one of them (got steps={steps!r}, epochs={epochs!r})")
    if steps is not None and not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
        raise ValueError(f"Invalid steps: {steps!r} (must be an integer >= 1)")
    if epochs is not None and not (real(epochs) and int(epochs / sample_rate) >= 1):
        raise ValueError(f"Invalid epochs: {epochs!r} (must make one step at least: epochs / sample_rate >= 1)")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"Invalid accountant: {accountant!r} (choose Opacus's 'prv', 'rdp' or 'gdp')")
    if not (real(tolerance) and tolerance > 0):
        raise ValueError(f"Invalid epsilon_tolerance: {tolerance!r} (must be a finite number > 0)")
