"""Every script in examples/ runs as written, briefly (a few steps each), learns, and prints the stock
optimizer's result and time beside the rule's."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# script -> (short arguments, a bound its returned metric must beat: above for accuracy, below for
# error, and the stock optimizer's and the rule's names, each starting a line of the output
# that ends with its time)
RUNS = {
    "foof_digits.py": (["--steps", "40"], ("above", 0.6), ("SGD (momentum 0.9)", "FOOF")),
    "kfac_digits_cnn.py": (["--steps", "10"], ("above", 0.0), ("SGD (momentum 0.9)", "K-FAC")),
    "eva_digits_cnn.py": (["--steps", "10"], ("above", 0.0), ("SGD (momentum 0.9)", "Eva")),
    "nlms_system_identification.py": (["--steps", "300"], ("below", 1e-2), ("SGD (LMS, lr 0.5)", "NLMS (lr 0.5)")),
    "lazy_adamw_bag_of_words.py": (["--steps", "5"], ("above", 0.0), ("AdamW (dense, fused)", "LazyAdamW")),
    "dp_sgd_digits.py": (["--epochs", "1"], ("above", 0.0), ("SGD (not private)", "DP-SGD")),
    # the busiest expert over the mean load
    "moe_load_balancing.py": (["--steps", "40"], ("below", 1.5), ("AdamW", "AdamW + LoadBalancing")),
}


def test_every_example_is_tested() -> None:
    assert {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")} == set(RUNS)


@pytest.mark.slow
@pytest.mark.parametrize("script", list(RUNS))
def test_example_runs(script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("sklearn")
    if script.startswith("dp_"):
        pytest.importorskip("opacus")
    monkeypatch.syspath_prepend(str(EXAMPLES))
    arguments, (direction, bound), (stock, rule) = RUNS[script]
    threads = torch.get_num_threads()
    try:
        result = runpy.run_path(str(EXAMPLES / script), run_name="example")["main"](arguments)
        assert torch.get_num_threads() == 1, script  # its printed times compare between runs
    finally:
        torch.set_num_threads(threads)
    assert math.isfinite(result)
    assert result > bound if direction == "above" else result < bound, (script, result)
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    # the stock optimizer's result and time on a line of its own, and the rule's
    assert any(line.startswith(f"{stock}: ") and line.endswith(" s") for line in lines), (script, stock, lines)
    assert any(line.startswith(f"{rule}: ") and line.endswith(" s") for line in lines), (script, rule, lines)
