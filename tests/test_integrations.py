"""The trainer callbacks in real ``Trainer`` runs: what they log is in the trainer's TensorBoard event files.

Each run trains a tiny random-weight model (no download) for a few steps, then reads the event files
back with TensorBoard's own reader and checks the tags, the steps and the values: the values against
the ``Monitor``'s last record and against ``optimizer.epsilon(delta)`` after the run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from inputaware_optim import DPSGD, FOOF, Monitor, NonFiniteFinder

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = [
    pytest.mark.filterwarnings("ignore:The '?train_dataloader'? does not have many workers"),
    pytest.mark.filterwarnings("ignore:.*is smaller than the logging interval"),
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore::inputaware_optim.CoverageWarning"),
]

STEPS, EVERY, DELTA = 5, 2, 1e-5
LOGGED_AT = [1, 3, 5]  # the Monitor logs from the first step, every EVERY: at the trainer's step counts


def scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Every scalar in the event files under ``folder``: {tag: {step: value}}."""
    found: dict[str, dict[int, float]] = {}
    for events in folder.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events.parent))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            found.setdefault(tag, {}).update({e.step: e.value for e in accumulator.Scalars(tag)})
    return found


def assert_logged_last_record(logged: dict[str, dict[int, float]], record: dict[str, Any], step: int) -> None:
    expected = {
        f"{statistic}/{name}": value
        for kind in ("modules", "parameters")
        for name, statistics in record[kind].items()
        for statistic, value in statistics.items()
    }
    assert expected
    for tag, value in expected.items():
        assert tag in logged, f"{tag} not logged; logged: {sorted(logged)}"
        assert logged[tag][step] == pytest.approx(value, rel=1e-6, abs=1e-7), tag


def test_importing_the_package_imports_no_trainer() -> None:
    code = (
        "import sys, inputaware_optim\n"
        "assert 'lightning' not in sys.modules and 'transformers' not in sys.modules\n"
        "from inputaware_optim import LightningMonitorCallback, HuggingFaceMonitorCallback\n"
        "assert 'lightning' in sys.modules and 'transformers' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_callbacks_validate_their_arguments() -> None:
    pytest.importorskip("lightning")
    from inputaware_optim import LightningMonitorCallback

    with pytest.raises(ValueError, match="Invalid every: 0"):
        LightningMonitorCallback(every=0)
    with pytest.raises(ValueError, match=r"Invalid delta: 1\.5"):
        LightningMonitorCallback(delta=1.5)
    with pytest.raises(ValueError, match="Invalid accountant: 'moments'"):
        LightningMonitorCallback(accountant="moments")
    with pytest.raises(AttributeError, match="no attribute 'NoSuchCallback'"):
        import inputaware_optim

        inputaware_optim.NoSuchCallback  # noqa: B018


# -- Lightning --------------------------------------------------------------------------------------


def lightning_fit(
    tmp_path: Path, make_optimizer: Any, callback: Any, steps: int = STEPS, ckpt_path: Path | None = None
) -> Any:
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import TensorBoardLogger

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.net)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=TensorBoardLogger(str(tmp_path), name="run"),
        log_every_n_steps=1,
        callbacks=[] if callback is None else [callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Classifier()
    trainer.fit(module, DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
    assert trainer.global_step == steps
    return module, trainer


@pytest.mark.parametrize("rule", ["FOOF", "torch.optim.SGD"])
def test_lightning_callback_logs_the_monitor_to_the_trainers_tensorboard(tmp_path: Path, rule: str) -> None:
    pytest.importorskip("lightning")
    from inputaware_optim import LightningMonitorCallback

    def make(net: nn.Module) -> torch.optim.Optimizer:
        if rule == "FOOF":
            return FOOF(net, lr=0.05, update_every=1)
        return torch.optim.SGD(net.parameters(), lr=0.05)

    callback = LightningMonitorCallback(every=EVERY)
    _, trainer = lightning_fit(tmp_path, make, callback)
    logged = scalars(Path(trainer.logger.log_dir))
    assert "train_loss" in logged  # the trainer's own scalars, in the same event files
    prefix = "" if rule == "FOOF" else "net."  # a plain optimizer is watched through the LightningModule
    for tag in (f"input_rms/{prefix}0", f"input_zero_fraction/{prefix}2", f"update_to_weight/{prefix}2.weight"):
        assert sorted(logged[tag]) == LOGGED_AT, tag  # at the trainer's global_step
    (monitor,) = callback.monitors
    assert_logged_last_record(logged, monitor.last, STEPS)
    assert not any(tag.startswith("privacy/") for tag in logged)


def test_lightning_callback_resumed_from_a_checkpoint_logs_at_the_steps_of_a_run_without_the_break(
    tmp_path: Path,
) -> None:
    # Its Monitor numbered steps from the resumed run's start: every 3 steps after a resume at step 4, it
    # logged at the trainer's steps 5 and 8, where the run without the break logs at 7.
    pytest.importorskip("lightning")
    from inputaware_optim import LightningMonitorCallback

    def make(net: nn.Module) -> torch.optim.Optimizer:
        return FOOF(net, lr=0.05, update_every=1)

    _, first = lightning_fit(tmp_path / "first", make, None, steps=4)  # one epoch of 4 batches
    first.save_checkpoint(tmp_path / "4.ckpt")
    callback = LightningMonitorCallback(every=3)
    _, trainer = lightning_fit(tmp_path / "resumed", make, callback, steps=8, ckpt_path=tmp_path / "4.ckpt")
    assert sorted(scalars(Path(trainer.logger.log_dir))["input_rms/0"]) == [7]
    _, whole = lightning_fit(tmp_path / "whole", make, LightningMonitorCallback(every=3), steps=8)
    assert sorted(scalars(Path(whole.logger.log_dir))["input_rms/0"]) == [1, 4, 7]
    (monitor,) = callback.monitors
    assert monitor.state_dict() == {"step": 8} and monitor.last is not None and monitor.last["step"] == 6


def test_lightning_callback_logs_dp_epsilon(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    pytest.importorskip("opacus")
    from inputaware_optim import LightningMonitorCallback

    optimizers = []

    def make(net: nn.Module) -> torch.optim.Optimizer:
        optimizers.append(DPSGD(net, lr=0.1, noise_multiplier=1.0, sample_rate=8 / 32, expected_batch_size=8))
        return optimizers[-1]

    _, trainer = lightning_fit(tmp_path, make, LightningMonitorCallback(every=EVERY, delta=DELTA, accountant="rdp"))
    logged = scalars(Path(trainer.logger.log_dir))
    assert sorted(logged["privacy/epsilon"]) == LOGGED_AT
    assert 0 < logged["privacy/epsilon"][1] < logged["privacy/epsilon"][3] < logged["privacy/epsilon"][5]
    expected = optimizers[0].epsilon(DELTA, accountant="rdp")
    assert logged["privacy/epsilon"][STEPS] == pytest.approx(expected, rel=1e-6)


def test_lightning_callback_warns_once_when_dp_cannot_account(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from inputaware_optim import LightningMonitorCallback

    def make(net: nn.Module) -> torch.optim.Optimizer:
        return DPSGD(net, lr=0.1, noise_multiplier=1.0)  # no sample_rate: no epsilon

    with pytest.warns(UserWarning, match="privacy spent is not logged: .*sample_rate"):
        _, trainer = lightning_fit(tmp_path, make, LightningMonitorCallback(every=EVERY))
    logged = scalars(Path(trainer.logger.log_dir))
    assert "input_rms/0" in logged and "privacy/epsilon" not in logged


# -- Hugging Face -----------------------------------------------------------------------------------

VOCAB, T, B = 40, 6, 4


def gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def language_data(count: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (count, T), generator=torch.Generator().manual_seed(0))
    # position ids of their own: DP needs them batched (GPT-2 otherwise builds them with batch 1)
    return [{"input_ids": i, "labels": i, "position_ids": torch.arange(T)} for i in ids]


def hugging_face_train(
    tmp_path: Path, model: nn.Module, optimizer: Any, callback: Any, resume: Path | None = None, **overrides: Any
) -> Any:
    transformers = pytest.importorskip("transformers")
    settings = {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": B,
        "max_steps": STEPS,
        "logging_steps": 1,
        "report_to": ["tensorboard"],
        "save_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
    }
    arguments = transformers.TrainingArguments(**{**settings, **overrides})
    trainer = transformers.Trainer(
        model=model,
        args=arguments,
        train_dataset=language_data(4 * B),
        optimizers=(optimizer, None),
        callbacks=[] if callback is None else [callback],
    )
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return trainer


def test_hugging_face_callback_writes_beside_the_trainers_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from inputaware_optim import HuggingFaceMonitorCallback

    model = gpt2()
    callback = HuggingFaceMonitorCallback(every=EVERY)
    hugging_face_train(tmp_path, model, FOOF(model, lr=0.05, update_every=1), callback)
    assert callback.log_dir is not None and Path(callback.log_dir).parent == tmp_path / "runs"
    logged = scalars(tmp_path / "runs")  # `tensorboard --logdir <output_dir>/runs` shows both
    assert "train/loss" in logged  # the trainer's own TensorBoardCallback
    assert sorted(logged["input_rms/transformer.h.0.mlp.c_fc"]) == LOGGED_AT
    assert sorted(logged["update_to_weight/transformer.h.0.attn.c_attn.weight"]) == LOGGED_AT
    (monitor,) = callback.monitors
    assert_logged_last_record(logged, monitor.last, STEPS)


def test_hugging_face_callback_resumed_from_a_checkpoint_logs_at_the_steps_of_a_run_without_the_break(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    from inputaware_optim import HuggingFaceMonitorCallback

    model = gpt2()
    first = tmp_path / "first"
    hugging_face_train(first, model, FOOF(model, lr=0.05), None, max_steps=4, save_strategy="steps", save_steps=4)
    model = gpt2()
    callback = HuggingFaceMonitorCallback(every=3)
    hugging_face_train(tmp_path, model, FOOF(model, lr=0.05), callback, resume=first / "checkpoint-4", max_steps=8)
    assert sorted(scalars(tmp_path / "runs")["input_rms/transformer.h.0.mlp.c_fc"]) == [7]  # as 1, 4, 7 unbroken
    (monitor,) = callback.monitors
    assert monitor.state_dict() == {"step": 8}


def test_hugging_face_callback_logs_dp_epsilon_into_the_trainers_own_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("opacus")
    from inputaware_optim import HuggingFaceMonitorCallback

    folder = tmp_path / "tensorboard"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(folder))  # the TensorBoardCallback's own setting
    model = gpt2()
    optimizer = DPSGD(model, lr=0.1, noise_multiplier=1.0, sample_rate=B / (4 * B), generator=torch.Generator())
    callback = HuggingFaceMonitorCallback(every=EVERY, delta=DELTA, accountant="rdp")
    hugging_face_train(tmp_path / "out", model, optimizer, callback, max_grad_norm=0.0)  # DP clips each sample
    assert callback.log_dir == str(folder)
    logged = scalars(folder)
    assert "train/loss" in logged
    assert sorted(logged["privacy/epsilon"]) == LOGGED_AT
    assert logged["privacy/epsilon"][STEPS] == pytest.approx(optimizer.epsilon(DELTA, accountant="rdp"), rel=1e-6)
    assert_logged_last_record(logged, callback.monitors[0].last, STEPS)


def test_hugging_face_callback_takes_a_writer(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from torch.utils.tensorboard import SummaryWriter

    from inputaware_optim import HuggingFaceMonitorCallback

    model = gpt2()
    writer = SummaryWriter(str(tmp_path / "shared"))
    callback = HuggingFaceMonitorCallback(every=1, tensorboard=writer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # a plain optimizer, through a capture of the model
    hugging_face_train(tmp_path / "out", model, optimizer, callback, report_to=[])
    writer.close()
    logged = scalars(tmp_path / "shared")
    assert sorted(logged["input_rms/transformer.h.0.mlp.c_proj"]) == list(range(1, STEPS + 1))
    assert_logged_last_record(logged, callback.monitors[0].last, STEPS)


# -- Accelerate -------------------------------------------------------------------------------------


def accelerate_run(
    folder: Path, steps: range, load: bool, rule: str = "FOOF"
) -> tuple[list[dict[str, Any]], Any, Any, Any]:
    """``steps`` optimizer steps of 2 accumulated micro-batches under Accelerate, with a Monitor (every 2) and a
    NonFiniteFinder given the prepared (wrapped) optimizer and registered for checkpointing; from ``folder``'s
    saved state if ``load``, saved there after. The records, the accelerator, the model and the monitor."""
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer: Any = (
        FOOF(model, lr=0.05, update_every=1)
        if rule == "FOOF"
        else DPSGD(model, lr=0.05, max_grad_norm=1.0, expected_batch_size=12)
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    records: list[dict[str, Any]] = []
    monitor = Monitor(optimizer, every=2, callback=records.append)
    finder = NonFiniteFinder(optimizer)
    accelerator.register_for_checkpointing(monitor, finder)
    if load:
        accelerator.load_state(str(folder))
    for step in steps:
        for micro in range(2):
            with accelerator.accumulate(model):
                x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2 * step + micro))
                accelerator.backward(model(x).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
    accelerator.save_state(str(folder))
    return records, monitor, finder, model


def test_monitor_and_finder_take_accelerates_optimizer_and_resume_through_its_checkpoints(tmp_path: Path) -> None:
    # Given Accelerate's wrapper, the Monitor asked for the model and watched it with a capture of its own, as if the
    # optimizer were a plain one; neither tool had a state for accelerator.save_state to keep.
    whole, _, _, unbroken = accelerate_run(tmp_path / "whole", range(5), load=False)
    first, monitor, _, _ = accelerate_run(tmp_path / "saved", range(3), load=False)
    assert monitor.optimizer is not None and isinstance(monitor.optimizer, FOOF)
    assert monitor.capture is monitor.optimizer.capture  # the optimizer's own capture: no second one
    second, monitor, finder, resumed = accelerate_run(tmp_path / "saved", range(3, 5), load=True)
    assert [r["step"] for r in whole] == [0, 2, 4]
    assert first + second == whole
    assert monitor.state_dict() == finder.state_dict() == {"step": 5}
    for got, expected in zip(resumed.parameters(), unbroken.parameters(), strict=True):
        assert torch.equal(got, expected)


def test_monitor_on_accelerates_wrapper_of_a_dp_optimizer_says_its_statistics_are_not_private(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="Monitor on DPSGD: .* the privacy guarantee does not cover"):
        accelerate_run(tmp_path, range(1), load=False, rule="DPSGD")
