"""The judging rule of tests/multiprocess.py: a SIGABRT is forgiven only after every rank's marker."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .multiprocess import HUNG_IN_TEARDOWN, failures, mark_done, run_spawned, run_torchrun

ABORT = -signal.SIGABRT


@pytest.mark.parametrize(
    ("codes", "marked", "bad"),
    [
        ({0: 0, 1: 0}, [], []),  # a clean exit needs nothing more
        ({0: ABORT, 1: 0}, [0, 1], []),  # the teardown abort, after every rank finished
        ({0: 134, 1: ABORT}, [0, 1], []),  # as a shell reports it
        ({0: ABORT, 1: 0}, [0], [0]),  # rank 1 had not finished when rank 0 aborted
        ({0: ABORT, 1: 0}, [1], [0]),  # rank 0 aborted before finishing
        ({0: 1, 1: 0}, [0, 1], [0]),  # an error after the marker is still an error
        ({0: -signal.SIGSEGV, 1: 0}, [0, 1], [0]),  # so is any other signal
        ({0: -signal.SIGTERM, 1: ABORT}, [0, 1], [0]),
        ({0: None, 1: 0}, [0, 1], [0]),  # timed out
        ({0: HUNG_IN_TEARDOWN, 1: 0}, [0, 1], []),  # the teardown hung, after every rank finished
        ({0: HUNG_IN_TEARDOWN, 1: 0}, [1], [0]),  # rank 0 hung before finishing
    ],
)
def test_failures(codes: dict[int, int | None], marked: list[int], bad: list[int], tmp_path: Path) -> None:
    for rank in marked:
        mark_done(tmp_path, rank)
    problems = failures(tmp_path, codes)
    assert [int(problem.split()[1].rstrip(":")) for problem in problems] == bad, problems


def _entry(rank: int, directory: str, mode: str) -> None:
    print(f"rank {rank} working", flush=True)
    started = Path(directory, "rank-0-started")
    if rank == 0:
        started.touch()
    elif mode in ("raise", "abort-early"):  # fail only once rank 0 has written its line (else a race)
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    if mode == "raise" and rank == 1:
        raise ValueError("rank 1 broke")
    if mode == "abort-early" and rank == 1:
        os.abort()
    mark_done(directory, rank)
    if mode == "abort-late" and rank == 0:
        os.abort()


@pytest.mark.slow
def test_spawned_forgives_an_abort_after_every_marker() -> None:
    run_spawned(_entry, ("abort-late",))


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "shown"), [("raise", "ValueError: rank 1 broke"), ("abort-early", "SIGABRT")])
def test_spawned_fails_otherwise_with_the_output(mode: str, shown: str) -> None:
    with pytest.raises(AssertionError, match="multi-process run failed") as failed:
        run_spawned(_entry, (mode,))
    assert shown in str(failed.value) and "rank 0 working" in str(failed.value)


SCRIPT = """
import os, sys, time
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
dist.barrier()
if rank == 1 and "{mode}" == "raise":
    raise ValueError("rank 1 broke")
if rank == 0 and "{mode}" == "hang-early":
    time.sleep(600)
dist.destroy_process_group()
if rank == 0 and "{mode}" == "hang-late":
    time.sleep(600)
if rank == 0 and "{mode}" == "abort-late":
    sys.stdout.flush()
    os.abort()
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_torchrun_forgives_an_abort_after_destroy_process_group(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(mode="abort-late")))
    run_torchrun(script)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_torchrun_fails_otherwise_with_the_output(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(mode="raise")))
    with pytest.raises(AssertionError, match="multi-process run failed") as failed:
        run_torchrun(script)
    assert "ValueError: rank 1 broke" in str(failed.value)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_torchrun_forgives_a_hang_in_teardown_after_every_marker_and_fails_one_before(tmp_path: Path) -> None:
    # Under load torch's gloo teardown can hang instead of aborting (a CI run once stopped at the
    # 180 s timeout with every rank past its work): stopped once every marker is TEARDOWN_GRACE old.
    late = tmp_path / "late.py"
    late.write_text(textwrap.dedent(SCRIPT.format(mode="hang-late")))
    started = time.monotonic()
    run_torchrun(late, timeout=120, teardown_grace=3)
    assert time.monotonic() - started < 100
    early = tmp_path / "early.py"
    early.write_text(textwrap.dedent(SCRIPT.format(mode="hang-early")))
    with pytest.raises(AssertionError, match="timed out after 20 s"):
        run_torchrun(early, timeout=20, teardown_grace=3)
