"""``python -m benchmarks``: run the benchmark sections, or regenerate the report from a run.

Examples::

    python -m benchmarks                          # the default run (2 h 40 min on a 2-core CPU)
    python -m benchmarks --quick                  # everything small, 67 to 84 s on a 2-core CPU
    python -m benchmarks --sections foof,nlms --repeats 9
    python -m benchmarks --report                 # benchmarks/README.md from the latest (full) run
    python -m benchmarks --report RUN --report-to /tmp/report   # any run's report, elsewhere
    python -m benchmarks --report FULL RERUN      # the full run, RERUN's sections (re-run later) replacing its own
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from . import plots, report
from .core import SIZES, Config, RunProgress, Section, Size
from .machine import describe
from .sections import SECTIONS

PACKAGE = Path(__file__).resolve().parent
RUNS = PACKAGE / "out"
RESULTS_FILE = "results.json"


def _parser() -> argparse.ArgumentParser:
    names = ", ".join(s.name for s in SECTIONS)
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmarks of inputaware_optim against the stock torch.optim optimizers.",
    )
    parser.add_argument("--sections", default="all", help=f"comma-separated sections to run (default: all): {names}")
    parser.add_argument("--size", choices=SIZES, default="default", help="model and run sizes (default: default)")
    parser.add_argument("--quick", action="store_true", help="everything small: --size quick, short samples")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="interleaved timing pairs per comparison (default: 15; 5 with --quick)",
    )
    parser.add_argument(
        "--sample-ms", type=float, default=None, help="minimum length of one timed sample (default: 50; 5 with --quick)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for the whole run (default: 1, which keeps a run's timings steady on a machine "
        "doing other work; more threads on a loaded machine make small steps many times slower)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of every model and data set (default: 0)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: benchmarks/out/<timestamp>)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--list", action="store_true", help="list the sections and exit")
    parser.add_argument(
        "--report",
        nargs="*",
        default=None,
        metavar="RUN",
        help="write the report from a run (its folder or JSON; default: the latest under benchmarks/out) "
        "instead of running; after it, runs of some sections re-run later replace those sections",
    )
    parser.add_argument(
        "--report-to",
        type=Path,
        default=PACKAGE,
        help="folder that receives README.md and results/*.png (default: benchmarks/)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="let --report overwrite the committed report (benchmarks/) from a --quick, non-default size or "
        "partial run",
    )
    return parser


def _selected(spec: str) -> list[Section]:
    if spec == "all":
        return list(SECTIONS)
    by_name = {s.name: s for s in SECTIONS}
    wanted = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in by_name]
    if unknown:
        raise SystemExit(f"unknown section(s): {', '.join(unknown)}; choose from {', '.join(by_name)}")
    return [by_name[name] for name in wanted]


def _config(args: argparse.Namespace) -> Config:
    size: Size = "quick" if args.quick else args.size
    quick = size == "quick"
    pairs = args.repeats if args.repeats is not None else (5 if quick else 15)
    if pairs < 5:
        raise SystemExit(f"--repeats must be at least 5 (the methodology's minimum of interleaved pairs), got {pairs}")
    sample_ms = args.sample_ms if args.sample_ms is not None else (5.0 if quick else 50.0)
    if args.threads < 1:
        raise SystemExit(f"--threads must be at least 1, got {args.threads}")
    return Config(
        size=size,
        pairs=pairs,
        sample_seconds=sample_ms / 1e3,
        warmup_seconds=0.02 if quick else 0.1,
        threads=args.threads,
        seed=args.seed,
    )


def _latest_run() -> Path:
    runs = list(RUNS.glob(f"*/{RESULTS_FILE}"))
    if not runs:
        raise SystemExit(f"no run found under {RUNS}; run `python -m benchmarks` first or pass --report RUN")
    return max(runs, key=lambda path: path.stat().st_mtime)


def _write(path: Path, run: dict[str, Any]) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(run, indent=1, allow_nan=False))
    temporary.replace(path)


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    sections = _selected(args.sections)
    config = _config(args)
    torch.set_num_threads(config.threads)
    started = datetime.now(timezone.utc)
    out = args.out or RUNS / started.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    run: dict[str, Any] = {
        "schema": 1,
        "command": "python -m benchmarks" + "".join(f" {shlex.quote(a)}" for a in argv),
        "started": started.isoformat(timespec="seconds"),
        "config": config.__dict__,
        "machine": describe(),
        "sections": {},
    }
    failed = False
    begin = time.perf_counter()
    bar = RunProgress(sections, config.size, enabled=not args.no_progress)
    for section in sections:
        section_begin = time.perf_counter()
        title, summary = section.heading(config)
        try:
            result = section.run(config, bar.section(section.name))
        except Exception:  # one broken section must not lose the others' numbers
            bar.end_section()
            failed = True
            error = traceback.format_exc()
            bar.write(error.rstrip(), file=sys.stderr)
            run["sections"][section.name] = {"title": title, "summary": summary, "error": error}
            continue
        bar.end_section()
        entry = {
            "title": title,
            "summary": summary,
            "duration_seconds": time.perf_counter() - section_begin,
            **result.to_json(),
        }
        entry["images"] = [plots.render_to(plot, out / plots.file_name(section.name, plot)) for plot in result.plots]
        run["sections"][section.name] = entry
        bar.write(report.text_section(section.name, entry))
        run["duration_seconds"] = time.perf_counter() - begin
        _write(out / RESULTS_FILE, run)
    bar.close()
    run["duration_seconds"] = time.perf_counter() - begin
    run["targets"] = report.all_targets(run)
    _write(out / RESULTS_FILE, run)
    print(report.text_targets(run))
    print(f"\nFinished in {run['duration_seconds']:.0f} s. Results: {out / RESULTS_FILE} (and PNG plots in {out}).")
    print(f"Regenerate the committed report with: python -m benchmarks --report {out}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default: the process's arguments); returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.list:
        for section in SECTIONS:
            print(f"{section.name:<18} {section.title}")
        return 0
    if args.report is not None:
        sources = [Path(given) for given in args.report] or [_latest_run()]
        sources = [source / RESULTS_FILE if source.is_dir() else source for source in sources]
        if not args.force:
            run, _ = report.combine(sources)
            refusal = report.overwrite_refusal(run, args.report_to, [s.name for s in SECTIONS], committed=PACKAGE)
            if refusal:
                raise SystemExit(refusal)
        destination = report.write(sources, args.report_to)
        print(f"Wrote {destination}")
        return 0
    return _run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
