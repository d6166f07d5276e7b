"""``python -m inputaware_optim plot LOG.jsonl -o out.png``: a ``Monitor`` log as per-layer heatmaps."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: the process's arguments); returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m inputaware_optim",
        description="'plot LOG.jsonl -o out.png' draws a Monitor's log as per-layer heatmaps.",
    )
    plot = parser.add_subparsers(dest="command", required=True).add_parser(
        "plot", help="per-layer heatmaps over steps (input RMS, zero fraction, update/weight) from a JSON-lines log"
    )
    plot.add_argument("log", help="the JSON-lines file a Monitor(..., jsonl=...) wrote")
    plot.add_argument("-o", "--out", default="monitor.png", help="the PNG to write (default: monitor.png)")
    args = parser.parse_args(argv)
    from .plot import plot as draw

    print(f"Wrote {draw(args.log, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
