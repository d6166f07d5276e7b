"""benchmarks/gpu_check.py: skips cleanly without CUDA, and its checks run on the CPU as a dry run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parent.parent


def test_skips_cleanly_without_cuda() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device, even on a machine with one
    finished = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert finished.returncode == 0, finished.stderr
    assert "skipped: no CUDA" in finished.stdout
    assert finished.stderr == ""


@pytest.mark.slow
def test_dry_run_on_cpu_passes_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--device", "cpu", "--compile-backend", "aot_eager", "--steps", "2", "--rounds", "1"]
    assert gpu_check.main(argv) == 0
    out = capsys.readouterr().out
    for check in gpu_check.CHECKS:
        assert f"\n{check} " in out, out
    for rule in gpu_check.RULES:
        assert f"amp     | {rule} " in out and f"compile | {rule} " in out, out
    assert "FAIL" not in out


def test_a_difference_from_stock_fails_the_row() -> None:
    a: list[Any] = [torch.zeros(3), {"step": torch.tensor(2.0), "n": 1}]
    b: list[Any] = [torch.zeros(3), {"step": torch.tensor(2.0), "n": 1}]
    assert gpu_check._same(a, b)
    b[0][1] = 1e-30
    assert not gpu_check._same(a, b)
    assert not gpu_check._same(a, [torch.zeros(3), {"step": torch.tensor(2.0)}])
    table = gpu_check.table([gpu_check.Row("kernels", "x", False, "differs", 1.5)])
    assert "FAIL" in table and "1.50x" in table


def test_unknown_check_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--device", "cpu", "--checks", "kernels,warp"]) == 2
    assert "unknown checks: warp" in capsys.readouterr().err
