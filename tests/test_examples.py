"""Every script in examples/ runs as written, briefly (a few steps each), and learns."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# script -> (short arguments, a bound its returned metric must beat: above for accuracy, below for error)
RUNS = {
    "foof_digits.py": (["--steps", "40"], ("above", 0.6)),
    "kfac_digits_cnn.py": (["--steps", "10"], ("above", 0.0)),
    "eva_digits_cnn.py": (["--steps", "10"], ("above", 0.0)),
    "nlms_system_identification.py": (["--steps", "300"], ("below", 1e-2)),
    "lazy_adamw_bag_of_words.py": (["--steps", "5"], ("above", 0.0)),
    "dp_sgd_digits.py": (["--epochs", "1"], ("above", 0.0)),
    "moe_load_balancing.py": (["--steps", "40"], ("below", 1.5)),  # the busiest expert over the mean load
}


def test_every_example_is_tested() -> None:
    assert {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")} == set(RUNS)


@pytest.mark.parametrize("script", list(RUNS))
def test_example_runs(script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("sklearn")
    if script.startswith("dp_"):
        pytest.importorskip("opacus")
    monkeypatch.syspath_prepend(str(EXAMPLES))
    arguments, (direction, bound) = RUNS[script]
    result = runpy.run_path(str(EXAMPLES / script), run_name="example")["main"](arguments)
    assert math.isfinite(result)
    assert result > bound if direction == "above" else result < bound, (script, result)
    assert capsys.readouterr().out.strip()
