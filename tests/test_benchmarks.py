"""The benchmarks run end to end (``python -m benchmarks --quick``) and their report renders from the JSON."""

from __future__ import annotations

import io
import json
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

for _module in ("matplotlib", "sklearn", "tqdm", "opacus"):  # the bench extra
    pytest.importorskip(_module)

ROOT = Path(__file__).resolve().parent.parent
TARGETED = {"hook_cost", "capture_overhead", "memory", "foof", "lazy_adamw", "grad_outputs", "kfac", "dp", "monitor"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("benchmarks")
    finished = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--no-progress", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return out


def _numbers(value: Any) -> Iterator[float]:
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield float(value)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)


def test_quick_run_records_every_section_with_numbers_and_targets(quick_run: Path) -> None:
    from benchmarks.sections import SECTIONS

    run = json.loads((quick_run / "results.json").read_text())
    assert set(run["sections"]) == {section.name for section in SECTIONS}
    assert "--quick" in run["command"]
    assert run["machine"]["torch_threads"] >= 1 and run["machine"]["torch"]
    for name, section in run["sections"].items():
        assert "error" not in section, section.get("error")
        numbers = list(_numbers(section["data"]))
        assert len(numbers) > 10, name
        assert all(math.isfinite(n) for n in numbers), name
        assert section["tables"] and all(table["rows"] for table in section["tables"]), name
        for table in section["tables"]:
            assert not any("nan" in cell.lower() for row in table["rows"] for cell in row), (name, table["title"])
        for plot in section["plots"]:
            assert (quick_run / f"{name}-{plot['name']}.png").stat().st_size > 0
            # Every legend term is explained in the caption.
            labels = {series["label"].split(" lr=")[0] for panel in plot["panels"] for series in panel["series"]}
            assert all(label in plot["caption"] for label in labels), (name, plot["name"], labels)
    targets = run["targets"]
    assert {t["section"] for t in targets} >= TARGETED
    for target in targets:
        assert isinstance(target["passed"], bool)
        assert target["requirement"] and target["shown"]
        # Every target is a bound on its measured value, so it can fail (no "ratios on both sides of 1").
        assert target["limit"] is not None and math.isfinite(target["limit"]), target["name"]
        if target["measured"] is None:
            assert not target["passed"], target["name"]
        else:
            assert math.isfinite(target["measured"]), target["name"]


def test_quick_run_dp_equals_opacus_and_kfac_trains_beside_the_others(quick_run: Path) -> None:
    sections = json.loads((quick_run / "results.json").read_text())["sections"]
    dp = sections["dp"]["data"]
    for name, workload in dp["workloads"].items():
        by_dtype = {result["dtype"]: result["relative_difference"] for result in workload["equality"]}
        # Not a timing: with the noise off the two implementations compute the same update.
        assert by_dtype["float64"] < 1e-10 and by_dtype["float32"] < 1e-4, (name, by_dtype)
        ghost = {result["dtype"]: result["ghost_relative_difference"] for result in workload["equality"]}
        assert ghost["float64"] < 1e-10, (name, ghost)  # Opacus's ghost mode is given the same clipping
        assert workload["max_grad_norm"] > 0
    for model in ("MLP", "CNN"):
        runs = sections["kfac"]["data"][model]["runs"]
        assert set(runs) == {"SGD (momentum 0.9)", "AdamW", "FOOF (update_every=10)", "K-FAC (update_every=10)"}
    assert sections["grad_outputs"]["data"]["in_place_relu"]["Capture(model, grad_outputs=True)"]["works"]


def test_quick_run_outputs_name_no_issue_numbers(quick_run: Path) -> None:
    # Targets say what they are ("target", "informational"), not which of this project's issues asked for them.
    text = (quick_run / "results.json").read_text()
    assert not re.search(r"\bissues?\s*#?\d", text, re.IGNORECASE)


def test_report_renders_from_the_json(quick_run: Path, tmp_path: Path) -> None:
    from benchmarks.__main__ import main

    assert main(["--report", str(quick_run), "--report-to", str(tmp_path)]) == 0
    readme = (tmp_path / "README.md").read_text()
    run = json.loads((quick_run / "results.json").read_text())
    assert "Do not edit by hand" in readme and run["command"] in readme
    for section in run["sections"].values():
        assert section["title"] in readme
    for target in run["targets"]:
        assert target["name"] in readme
    images = list((tmp_path / "results").glob("*.png"))
    assert images and all(f"results/{image.name}" in readme for image in images)


def _fake_run(size: str, sections: list[str]) -> dict[str, Any]:
    """The least of a run's JSON that ``--report`` reads."""
    return {
        "command": f"python -m benchmarks --size {size}",
        "started": "2026-01-01T00:00:00+00:00",
        "duration_seconds": 1.0,
        "config": {"size": size, "pairs": 5, "sample_seconds": 0.005},
        "machine": {"cpu": "test", "cpus_available": 1, "torch": "0", "torch_threads": 1, "python": "3"},
        "sections": {
            name: {"title": name, "summary": "", "tables": [], "targets": [], "plots": [], "notes": []}
            for name in sections
        },
    }


def test_report_refuses_a_quick_or_partial_run_over_the_committed_report(tmp_path: Path) -> None:
    from benchmarks.report import overwrite_refusal

    every = ["foof", "kfac"]
    committed = tmp_path / "committed"
    assert overwrite_refusal(_fake_run("default", every), committed, every, committed=committed) is None
    quick = overwrite_refusal(_fake_run("quick", every), committed, every, committed=committed)
    assert quick is not None and "'quick'" in quick and "--force" in quick
    large = overwrite_refusal(_fake_run("large", every), committed, every, committed=committed)
    assert large is not None and "'large'" in large
    partial = overwrite_refusal(_fake_run("default", ["foof"]), committed, every, committed=committed)
    assert partial is not None and "kfac" in partial
    # Any run may be written somewhere else.
    assert overwrite_refusal(_fake_run("quick", ["foof"]), tmp_path / "other", every, committed=committed) is None


def test_report_cli_needs_force_to_overwrite_the_committed_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import benchmarks.__main__ as cli

    committed = tmp_path / "committed"
    committed.mkdir()
    (committed / "README.md").write_text("the committed report")
    monkeypatch.setattr(cli, "PACKAGE", committed)  # never the real benchmarks/ folder
    source = tmp_path / "run" / "results.json"
    source.parent.mkdir()
    source.write_text(json.dumps(_fake_run("quick", ["foof"])))
    with pytest.raises(SystemExit, match="not overwriting the committed report"):
        cli.main(["--report", str(source)])
    assert (committed / "README.md").read_text() == "the committed report"
    assert cli.main(["--report", str(source), "--force"]) == 0
    assert "Do not edit by hand" in (committed / "README.md").read_text()


def test_one_progress_bar_across_sections_counts_estimated_seconds() -> None:
    from benchmarks.core import Result, RunProgress, Section

    def section(name: str, estimate: tuple[float, float]) -> Section:
        return Section(name, name, "", lambda config, progress: Result(), estimate)

    shown = io.StringIO()
    bar = RunProgress([section("a", (1.0, 30.0)), section("b", (1.0, 10.0))], "default", file=shown)
    assert "about 00:40 left (estimate)" in shown.getvalue()  # before any work: the estimate itself
    progress = bar.section("a")
    progress.start(3)
    progress.advance("second")
    assert bar.position == pytest.approx(10.0)
    for _ in range(5):  # more units than announced stay within the section's share
        progress.advance()
    assert bar.position == pytest.approx(30.0)
    bar.end_section()
    bar.section("b")  # reports no units: its share is counted when it ends
    assert bar.position == pytest.approx(30.0)
    bar.end_section()
    assert bar.position == pytest.approx(40.0)
    bar.close()
    assert "2/2 b" in shown.getvalue() and "100%" in shown.getvalue()
