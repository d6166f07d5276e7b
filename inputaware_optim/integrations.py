"""Trainer callbacks: a ``Monitor`` on the trainer's optimizer, logged to the trainer's own logger.

``LightningMonitorCallback`` (a ``lightning.pytorch.Callback``) and ``HuggingFaceMonitorCallback``
(a ``transformers.TrainerCallback``) are built on first use, importing their framework then.
"""

from __future__ import annotations

import importlib
import os
import warnings
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from .dp import DPSGD, DPAdamW
from .monitor import Monitor, unwrap_optimizer

__all__ = ["HuggingFaceMonitorCallback", "LightningMonitorCallback"]


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer under a trainer's wrapper, refused by name if it is none."""
    optimizer = unwrap_optimizer(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"the trainer's optimizer is a {type(optimizer).__name__}, not a torch.optim.Optimizer")
    return optimizer


class _MonitorLogging:
    """What both callbacks share: the monitors, the records waiting for the trainer's step count, and ε."""

    def __init__(
        self, every: int | None = None, *, grad_outputs: bool = False, delta: float = 1e-5, accountant: str = "prv"
    ) -> None:
        super().__init__()  # (the framework's Callback, after this class)
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"Invalid every: {every!r}; it must be a positive integer (or None: the trainer's)")
        if not 0.0 < delta < 1.0:
            raise ValueError(f"Invalid delta: {delta!r} (must be in (0, 1))")
        if accountant not in ("prv", "rdp", "gdp"):
            raise ValueError(f"Invalid accountant: {accountant!r} (Opacus's 'prv', 'rdp' or 'gdp')")
        self.every, self.grad_outputs, self.delta, self.accountant = every, grad_outputs, delta, accountant
        self.monitors: list[Monitor] = []
        self._private: list[Any] = []  # the DP optimizers whose epsilon is logged
        self._pending: dict[str, float] = {}

    def _attach(self, optimizers: list[Any], model: torch.nn.Module, every: int, step: int) -> None:
        """A Monitor on each optimizer, numbering the coming step ``step`` (the trainer's, resumed or not)."""
        self._remove()
        self.monitors.clear()
        self._private.clear()
        optimizers = [_unwrap_optimizer(o) for o in optimizers]
        for index, optimizer in enumerate(optimizers):
            prefix = f"optimizer{index}/" if len(optimizers) > 1 else ""
            keep = partial(self._keep, prefix=prefix)  # (an input-aware optimizer's monitor watches its own model)
            self.monitors.append(Monitor(optimizer, model, every=every, grad_outputs=self.grad_outputs, callback=keep))
            self.monitors[-1].load_state_dict({"step": int(step)})
            if isinstance(optimizer, (DPSGD, DPAdamW)):
                try:
                    optimizer.epsilon(self.delta, accountant=self.accountant)
                except (ValueError, ImportError) as error:
                    warnings.warn(f"the privacy spent is not logged: {error}", UserWarning, stacklevel=3)
                else:
                    self._private.append((prefix, optimizer))

    def _keep(self, record: dict[str, Any], prefix: str) -> None:
        for kind in ("modules", "parameters"):
            for name, statistics in record[kind].items():
                self._pending.update({f"{prefix}{statistic}/{name}": float(v) for statistic, v in statistics.items()})

    def _take(self) -> dict[str, float]:
        """The scalars of the records since the last call, and ε where they are new."""
        scalars, self._pending = self._pending, {}
        if scalars:
            for prefix, optimizer in self._private:
                scalars[f"{prefix}privacy/epsilon"] = optimizer.epsilon(self.delta, accountant=self.accountant)
        return scalars

    def _remove(self) -> None:
        """Take the monitors off (their ``last`` records stay readable)."""
        for monitor in self.monitors:
            monitor.remove()


class _Lightning(_MonitorLogging):
    """Attaches a ``Monitor`` to each of a Lightning ``Trainer``'s optimizers at ``on_train_start``
    and logs its statistics (and ``privacy/epsilon`` for ``DPSGD``/``DPAdamW``) to
    ``trainer.loggers`` at ``trainer.global_step`` (docs/integrations/lightning.md).

    Args:
        every: Log every ``every`` optimizer steps (default: the trainer's ``log_every_n_steps``).
        grad_outputs: Also log output-gradient statistics.
        delta: The :math:`\\delta` the logged :math:`\\varepsilon` is for (DP optimizers only).
        accountant: Opacus's accountant for :math:`\\varepsilon`: ``"prv"``, ``"rdp"`` or ``"gdp"``.

    Attributes:
        monitors: The monitors attached during training, one per optimizer.
    """

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        every = self.every if self.every is not None else max(1, int(getattr(trainer, "log_every_n_steps", 1)))
        self._attach(list(trainer.optimizers), pl_module, every, trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._write(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer)
        self._remove()

    def _write(self, trainer: pl.Trainer) -> None:
        scalars = self._take()
        if scalars and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(scalars, step=trainer.global_step)


class _HuggingFace(_MonitorLogging):
    """Attaches a ``Monitor`` to a Hugging Face ``Trainer``'s optimizer at ``on_train_begin`` and
    writes its statistics (and ``privacy/epsilon`` for ``DPSGD``/``DPAdamW``) to TensorBoard at
    ``state.global_step``, from the main process (docs/integrations/hugging-face.md).

    Args:
        every: Log every ``every`` optimizer steps (default: the trainer's ``logging_steps``).
        grad_outputs: Also log output-gradient statistics.
        delta: The :math:`\\delta` the logged :math:`\\varepsilon` is for (DP optimizers only).
        accountant: Opacus's accountant for :math:`\\varepsilon`: ``"prv"``, ``"rdp"`` or ``"gdp"``.
        tensorboard: A ``SummaryWriter`` or a folder (default: ``TENSORBOARD_LOGGING_DIR``, else
            ``<output_dir>/runs/<time>_<host>``, as the ``TensorBoardCallback`` names its own).

    Attributes:
        monitors: The monitors attached during training.
        log_dir: The folder the scalars are written to (set when training begins).
    """

    def __init__(
        self,
        every: int | None = None,
        *,
        grad_outputs: bool = False,
        delta: float = 1e-5,
        accountant: str = "prv",
        tensorboard: Any = None,
    ) -> None:
        super().__init__(every, grad_outputs=grad_outputs, delta=delta, accountant=accountant)
        self.tensorboard = tensorboard
        self.log_dir: str | None = None
        self._writer: Any = None  # ours to close unless it is ``tensorboard``

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if optimizer is None or model is None:
            raise RuntimeError("HuggingFaceMonitorCallback: the Trainer handed the callback no model or optimizer")
        every = self.every if self.every is not None else max(1, int(state.logging_steps or 1))
        self._attach([optimizer], model, every, state.global_step)
        if not state.is_world_process_zero:
            return
        if self.tensorboard is not None and not isinstance(self.tensorboard, (str, os.PathLike)):
            self._writer = self.tensorboard
            self.log_dir = getattr(self._writer, "log_dir", None)
            return
        from torch.utils.tensorboard import SummaryWriter

        if self.tensorboard is not None:
            self.log_dir = os.fspath(self.tensorboard)
        elif os.getenv("TENSORBOARD_LOGGING_DIR"):
            self.log_dir = os.path.expanduser(os.environ["TENSORBOARD_LOGGING_DIR"])
        else:
            from transformers.integrations.integration_utils import default_logdir

            self.log_dir = os.path.join(args.output_dir, default_logdir())
        self._writer = SummaryWriter(log_dir=self.log_dir)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._write(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._write(state.global_step)
        self._remove()
        if self._writer is not None:
            self._writer.flush()
            if self._writer is not self.tensorboard:
                self._writer.close()
        self._writer = None

    def _write(self, step: int) -> None:
        scalars = self._take()
        if scalars and self._writer is not None:
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, step)
            self._writer.flush()


if TYPE_CHECKING:  # the classes are built by __getattr__ below, on first use
    import lightning.pytorch as pl
    from transformers import TrainerCallback

    class LightningMonitorCallback(_Lightning, pl.Callback): ...

    class HuggingFaceMonitorCallback(_HuggingFace, TrainerCallback): ...


_BASES = {
    "LightningMonitorCallback": (_Lightning, "lightning.pytorch", "Callback"),
    "HuggingFaceMonitorCallback": (_HuggingFace, "transformers", "TrainerCallback"),
}
_BUILT: dict[str, type] = {}


def __getattr__(name: str) -> type:
    """Build a callback class on first use, importing its framework then (PEP 562)."""
    if name not in _BASES:
        raise AttributeError(f"module 'inputaware_optim' has no attribute {name!r}")
    if name not in _BUILT:
        logging, package, base = _BASES[name]
        try:
            framework = importlib.import_module(package)
        except ImportError as error:
            raise ImportError(
                f"{name} needs its trainer's package: pip install 'inputaware_optim[integration]' "
                "(with torch pinned, see the README)"
            ) from error
        namespace = {"__module__": __name__, "__qualname__": name, "__doc__": logging.__doc__}
        _BUILT[name] = type(name, (logging, getattr(framework, base)), namespace)
    return _BUILT[name]
