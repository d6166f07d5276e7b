"""The benchmarks run end to end (``python -m benchmarks --quick``) and their report renders from the JSON."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

for _module in ("matplotlib", "sklearn", "tqdm", "opacus"):  # the bench extra
    pytest.importorskip(_module)

TARGETED = {
    "hook_cost",
    "capture_overhead",
    "memory",
    "foof",
    "lazy_adamw",
    "grad_outputs",
    "kfac",
    "convergence",
    "dp",
    "monitor",
    "gpt",
}


@contextlib.contextmanager
def _native_output_to(path: Path) -> Iterator[None]:
    """File descriptors 1 and 2, what native code (torch's profiler) prints, into ``path``."""
    with open(path, "wb") as sink:
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        try:
            for fd in saved:
                os.dup2(sink.fileno(), fd)
            yield
        finally:
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m benchmarks --quick``, in this process: no wall-clock limit to outrun on a loaded machine.

    What it printed is kept beside its results: ``console.txt`` (Python's output), ``native.txt`` (native code's).
    """
    from benchmarks.__main__ import main

    out = tmp_path_factory.mktemp("benchmarks")
    threads = torch.get_num_threads()
    console = io.StringIO()
    try:
        with (
            _native_output_to(out / "native.txt"),
            contextlib.redirect_stdout(console),
            contextlib.redirect_stderr(console),
        ):
            status = main(["--quick", "--no-progress", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    (out / "console.txt").write_text(console.getvalue())
    assert status == 0, console.getvalue()[-6000:]
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_quick_run_prints_no_profiler_notices(quick_run: Path) -> None:
    native = (quick_run / "native.txt").read_text(errors="replace")
    assert "USDT:" not in native and "USDT:" not in (quick_run / "console.txt").read_text(), native[-2000:]


@pytest.mark.slow
def test_quick_run_heads_the_gpt_section_with_the_model_it_ran(quick_run: Path) -> None:
    title = json.loads((quick_run / "results.json").read_text())["sections"]["gpt"]["title"]
    assert title.startswith("At quick size: a 0.1M-parameter GPT (2 blocks, width 64, 64 tokens per step)"), title
    assert f"== {title} (gpt, " in (quick_run / "console.txt").read_text()


def test_the_gpt_heading_counts_the_model_of_the_run() -> None:
    from benchmarks.core import Config
    from benchmarks.sections.gpt import SECTION

    quick, quick_summary = SECTION.heading(Config(size="quick"))
    assert "0.1M-parameter GPT (2 blocks, width 64, 64 tokens per step)" in quick and "realistic" not in quick
    assert "batch 2 × 32 tokens" in quick_summary and "arithmetic, dominates" not in quick_summary
    default, summary = SECTION.heading(Config())
    assert default.startswith("At realistic size: a 10.9M-parameter GPT (6 blocks, width 384, 1,024 tokens per step)")
    assert (default, summary) == (SECTION.title, SECTION.summary)  # what --list shows
    assert SECTION.heading(Config(size="large")) == (default, summary)  # large times the default GPT


def test_profiled_drops_kineto_usdt_lines_and_keeps_the_rest(capfd: pytest.CaptureFixture[str]) -> None:
    from benchmarks.machine import _native_stderr_without_usdt, profiled

    for _ in range(2):
        with profiled(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            torch.ones(4).sum()
    assert any(event.key == "aten::sum" for event in profiler.key_averages())
    with _native_stderr_without_usdt():
        os.write(2, b"USDT:2026-01-01 00:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"ERROR: a real one\n")
    captured = capfd.readouterr()
    assert "USDT:" not in captured.err + captured.out
    assert "ERROR: a real one" in captured.err


@pytest.mark.slow
def test_quick_run_dp_equals_opacus(quick_run: Path) -> None:
    sections = json.loads((quick_run / "results.json").read_text())["sections"]
    dp = sections["dp"]["data"]
    for name, workload in dp["workloads"].items():
        by_dtype = {result["dtype"]: result["relative_difference"] for result in workload["equality"]}
        # Not a timing: with the noise off the two implementations compute the same update.
        assert by_dtype["float64"] < 1e-10 and by_dtype["float32"] < 1e-4, (name, by_dtype)
        ghost = {result["dtype"]: result["ghost_relative_difference"] for result in workload["equality"]}
        assert ghost["float64"] < 1e-10, (name, ghost)  # Opacus's ghost mode is given the same clipping
        assert workload["max_grad_norm"] > 0
    assert sections["grad_outputs"]["data"]["in_place_relu"]["Capture(model, grad_outputs=True)"]["works"]


OPTIMIZERS = {"SGD (momentum 0.9)", "AdamW", "FOOF", "K-FAC", "Eva", "FOOF on AdamW"}
RULES = OPTIMIZERS - {"SGD (momentum 0.9)", "AdamW"}


@pytest.mark.slow
def test_quick_run_times_the_rules_on_their_schedule(quick_run: Path) -> None:
    run = json.loads((quick_run / "results.json").read_text())
    sections = run["sections"]
    for name, rules in (("foof", {"FOOF", "FOOF on AdamW"}), ("kfac", {"K-FAC", "Eva"})):
        for model in ("MLP", "CNN"):
            timing = sections[name]["data"]["models"][model]["64"]["timing"]
            assert rules <= set(timing["calls"]), (name, model)
            # Statistics and inverses every 10 steps: each sample spans whole periods of the schedule.
            assert all(timing["calls"][rule] % 10 == 0 for rule in rules), (name, model, timing["calls"])
    step_targets = [t for t in run["targets"] if t["section"] in ("foof", "kfac")]
    assert {t["name"].split(" training step")[0] for t in step_targets} == {"FOOF", "K-FAC", "Eva"}
    assert all(t["limit"] == 1.15 and t["unjudged"] == "not measured at quick size" for t in step_targets)


@pytest.mark.slow
def test_quick_run_convergence_trains_every_configuration_on_every_workload(quick_run: Path) -> None:
    run = json.loads((quick_run / "results.json").read_text())
    section = run["sections"]["convergence"]
    data = section["data"]
    stock = {"SGD (momentum 0.9)", "AdamW", "Muon"}
    geometries = {"Whitened Muon", "Two-sided Muon", "Eigenbasis Adam"}  # (docs/rules/candidates.md)
    gpt = stock | geometries | {"FOOF on AdamW", "FOOF on Muon", "K-FAC on AdamW", "Eva on AdamW"}
    digits = OPTIMIZERS | geometries | {"Muon", "FOOF on Muon"}
    for task, names in (("GPT", gpt), ("CNN", digits), ("autoencoder", digits)):
        result = data[task]
        assert set(result["seed_runs"]) == set(result["sweep_runs"]) == names, task
        assert result["best_stock"] in stock and result["best_candidate"] in names - stock
        assert result["goal"] is not None, task
        for name, runs in result["seed_runs"].items():
            assert len(runs) == data["seeds"] and len({r["seed"] for r in runs}) == data["seeds"], (task, name)
            assert len({r["lr"] for r in runs}) == 1, (task, name)  # every seed at the rate chosen on the first
            assert runs[0] in result["sweep_runs"][name], (task, name)
            assert len(result["reach"][name]["measured_seconds"]) == data["seeds"], (task, name)
            assert all(r["seconds"][-1] == r["measured_training_seconds"] > 0 for r in runs), (task, name)
        assert set(result["muon_step_timing"]["seconds"]) == {"AdamW", "Muon", "torch.optim.Muon as shipped"}
    targets = [t for t in run["targets"] if t["section"] == "convergence"]
    assert [t["limit"] for t in targets] == [0.85, 0.85, 0.85, 2.0]
    assert all(t["unjudged"] == "not measured at quick size" and not t["passed"] for t in targets)
    headline = [plot for plot in section["plots"] if plot["headline"]]
    assert [plot["name"] for plot in headline] == ["time-to-goal"]
    assert all(p["xlabel"] == "measured training time (s)" and p["ylim"] for p in headline[0]["panels"])


@pytest.mark.slow
def test_quick_run_tokens_measures_every_configuration_per_optimizer_step(quick_run: Path) -> None:
    run = json.loads((quick_run / "results.json").read_text())
    data = run["sections"]["tokens"]["data"]
    counts = [str(c) for c in data["micro_batches"]]
    assert counts == ["1", "2"]
    for by_name in data["ratios_vs_adamw"].values():
        assert set(by_name) >= {"AdamW", "FOOF → AdamW", "K-FAC → AdamW", "DPAdamW (σ = 1, C = 1)"}
        assert all(set(by_count) == set(counts) for by_count in by_name.values())
    # AdamW's step at one micro-batch is the GPT section's AdamW step (the same model and batch): a whole
    # optimizer step, not a share of a round of steps.
    width = next(iter(data["adamw_step_seconds"]))
    one = data["adamw_step_seconds"][width]["1"]
    gpt = run["sections"]["gpt"]["data"]["median_step_seconds"]["AdamW"]
    assert 0.4 < one / gpt < 2.5, (one, gpt)


@pytest.mark.slow
def test_quick_run_outputs_name_no_issue_numbers(quick_run: Path) -> None:
    # Targets say what they are ("target", "informational"), not which of this project's issues asked for them.
    text = (quick_run / "results.json").read_text()
    assert not re.search(r"\bissues?\s*#?\d", text, re.IGNORECASE)


@pytest.mark.slow
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


def test_report_combines_a_run_with_a_later_rerun_of_some_sections(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import benchmarks.__main__ as cli
    from benchmarks.report import combine

    every = [section.name for section in cli.SECTIONS]
    first, later = tmp_path / "first.json", tmp_path / "later.json"
    first.write_text(json.dumps(_fake_run("default", every)))
    rerun = _fake_run("default", [every[-1], every[0]])
    rerun["command"], rerun["started"] = "python -m benchmarks --sections again", "2026-02-02T00:00:00+00:00"
    rerun["machine"]["git_commit"] = "abcdef0123456789"
    rerun["sections"][every[0]]["title"] = "the re-run's title"
    later.write_text(json.dumps(rerun))

    run, folders = combine([first, later])
    assert list(run["sections"]) == every  # the registry's order, whatever order the re-run wrote
    assert run["sections"][every[0]]["title"] == "the re-run's title"
    assert run["sections"][every[0]]["run"]["git_commit"] == "abcdef0123456789"
    assert "run" not in run["sections"][every[1]]
    assert folders[every[0]] == later.parent

    committed = tmp_path / "committed"
    committed.mkdir()
    monkeypatch.setattr(cli, "PACKAGE", committed)
    assert cli.main(["--report", str(first), str(later)]) == 0  # together they are a full default run
    readme = (committed / "README.md").read_text()
    assert f"**Re-run later, sections {every[0]}, {every[-1]}:** `python -m benchmarks --sections again`" in readme
    assert "commit `abcdef012345`" in readme and "the re-run's title" in readme

    quick = _fake_run("quick", [every[0]])
    (tmp_path / "quick.json").write_text(json.dumps(quick))
    with pytest.raises(SystemExit, match="size differ"):
        combine([first, tmp_path / "quick.json"])


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


def test_a_colour_means_one_series_label_across_the_panels_of_a_plot() -> None:
    from benchmarks.core import Panel, Plot, Series
    from benchmarks.plots import colours

    def panel(*series: tuple[str, str]) -> Panel:
        return Panel(
            title="t",
            xlabel="step",
            ylabel="loss",
            series=[Series(label, [0.0], [1.0], style) for label, style in series],
        )

    plot = Plot(
        name="p", title="T", panels=[panel(("SGD", "r-"), ("FOOF", "b-")), panel(("FOOF", "r-"), ("DPSGD", "b--"))]
    )
    taken = colours(plot)
    assert taken["SGD"] == "r" and taken["FOOF"] == "b"  # FOOF keeps its first colour in the second panel
    assert len(set(taken.values())) == len(taken)  # DPSGD asked for FOOF's blue: it gets its own


@pytest.mark.slow
def test_untuned_workloads_run_and_report_time_to_muons_result() -> None:
    """``python -m benchmarks.untuned`` (docs/rules/whitened-muon.md quotes it): a few steps of each workload, every
    optimizer; the goal is Muon's median final metric, and a time to it is finite exactly when every seed (of two:
    the median of two times) reaches it."""
    pytest.importorskip("sklearn")
    from benchmarks import untuned

    for name in untuned.WORKLOADS:
        report = untuned.measure(name, steps=3, seeds=2, rates=(1e-2,))
        assert set(report["results"]) == {"AdamW", "Muon", "WhitenedMuon"}
        muon = report["results"]["Muon"]
        assert muon["final_median"] == report["goal"] == statistics.median(muon["finals"])
        for result in report["results"].values():
            assert len(result["finals"]) == 2 and result["seconds_per_step"] > 0
            reached = [s for s in result["steps_to_goal"] if s is not None]
            assert math.isfinite(result["time_to_goal"]) == (len(reached) == 2)
