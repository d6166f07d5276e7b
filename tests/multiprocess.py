"""Multi-process runs judged by what each rank recorded before teardown.

torch 2.13's gloo teardown now and then aborts a rank that has finished all its work: "terminate
called without an active exception", SIGABRT, after ``destroy_process_group()`` (plain torch.optim
scripts do the same). So each rank writes a marker file just before teardown, once its work and
checks are done, and a run passes when

- every rank exited 0, or
- every nonzero exit is SIGABRT (-6, or 134 through a shell) and every rank's marker is present.

Under load the same teardown can hang instead (a rank that wrote its marker never exits): once every
rank's marker has been there for ``TEARDOWN_GRACE`` seconds, ``run_torchrun`` stops the run and
counts such a rank as that teardown too.

Anything else (an exception, a SIGABRT before some rank's marker, another signal or exit code, a
timeout) fails, showing each rank's exit code, marker and output.

Also the per-rank launcher of ``run_torchrun``: ``python tests/multiprocess.py DIR SCRIPT``. It
imports only the standard library; torch is imported in the rank it launches.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ABORT_CODES = frozenset({-signal.SIGABRT, 128 + signal.SIGABRT})  # as Popen/multiprocessing report it; via a shell
TAIL = 4000  # characters of each rank's output shown on failure
TEARDOWN_GRACE = 60.0  # seconds a run may hang in teardown once every rank has finished its work
HUNG_IN_TEARDOWN = -1000  # the exit code recorded for a rank stopped there (not a real exit code)


def _marker(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.done"


def _log(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.log"


def _exit_file(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.exit"


def mark_done(directory: str | Path, rank: int, note: str = "ok") -> None:
    """Record that ``rank`` finished its work and checks; call it just before teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    path = _marker(Path(directory), rank)
    partial = path.with_suffix(".partial")
    partial.write_text(f"rank {rank} {note}\n")
    os.replace(partial, path)  # the marker is whole or absent


def failures(directory: str | Path, exit_codes: Mapping[int, int | None]) -> list[str]:
    """Why the run failed, one entry per failed rank (``None``: no exit code); empty when it passed."""
    directory = Path(directory)
    missing = [rank for rank in sorted(exit_codes) if not _marker(directory, rank).is_file()]
    problems = []
    for rank, code in sorted(exit_codes.items()):
        if code == 0:
            continue
        if code is None:
            problems.append(f"rank {rank}: no exit code (timed out, or stopped after another rank failed)")
        elif (code in ABORT_CODES or code == HUNG_IN_TEARDOWN) and not missing:
            continue  # torch's gloo teardown, after every rank had finished its work
        elif code in ABORT_CODES:
            problems.append(f"rank {rank}: SIGABRT while ranks {missing} had not finished their work")
        else:
            problems.append(f"rank {rank}: exit code {code}{_signal_name(code)}")
    return problems


def report(
    directory: str | Path, exit_codes: Mapping[int, int | None], problems: Sequence[str], extra: str = ""
) -> str:
    """The failure message: the problems, then each rank's exit code, marker and output."""
    directory = Path(directory)
    lines = ["multi-process run failed:", *(f"  {problem}" for problem in problems)]
    for rank, code in sorted(exit_codes.items()):
        marker = _marker(directory, rank)
        log = _log(directory, rank)
        lines.append(
            f"----- rank {rank}: exit code {code}{_signal_name(code)}; marker: "
            + (marker.read_text().strip() if marker.is_file() else "none")
        )
        lines.append(log.read_text(errors="replace")[-TAIL:] if log.is_file() else "(no output file)")
    if extra:
        lines += ["----- torchrun", extra[-2 * TAIL :]]
    return "\n".join(lines)


def _signal_name(code: int | None) -> str:
    if code is None or not (code < 0 or code > 128):
        return ""
    try:
        return f" ({signal.Signals(-code if code < 0 else code - 128).name})"
    except ValueError:
        return ""


# ----------------------------------------------------------------------------------------------
# Spawned processes (instead of torch.multiprocessing.spawn, which raises on any nonzero exit and
# terminates the other ranks before they can finish).


def _spawned_rank(entry: Callable[..., None], rank: int, directory: str, args: tuple[Any, ...]) -> None:
    log = open(_log(Path(directory), rank), "w")  # noqa: SIM115 - kept open until the process ends
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    entry(rank, directory, *args)  # an exception: multiprocessing prints it (into the log), exit code 1


def run_spawned(entry: Callable[..., None], args: tuple[Any, ...] = (), world: int = 2, timeout: float = 300) -> None:
    """Run ``entry(rank, directory, *args)`` in ``world`` spawned processes; raise if the run failed.

    ``entry`` must be importable (module level) and call ``mark_done(directory, rank)`` once its work
    and checks are done, just before tearing down.
    """
    import multiprocessing.connection

    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ranks-") as directory:
        processes = {
            rank: context.Process(target=_spawned_rank, args=(entry, rank, directory, args)) for rank in range(world)
        }
        for process in processes.values():
            process.start()
        deadline = time.monotonic() + timeout
        running = dict(processes)
        while running and time.monotonic() < deadline:
            sentinels = [p.sentinel for p in running.values()]
            multiprocessing.connection.wait(sentinels, timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            for rank, process in list(running.items()):
                if process.exitcode is None:
                    continue
                del running[rank]
                finished = process.exitcode == 0 or (
                    process.exitcode in ABORT_CODES and _marker(Path(directory), rank).is_file()
                )
                if not finished:  # the others would wait for it in a collective until their timeout
                    deadline = 0.0
        for process in running.values():
            process.terminate()
        for process in running.values():
            process.join(10)
            if process.exitcode is None:
                process.kill()
                process.join()
        codes = {rank: None if rank in running else p.exitcode for rank, p in processes.items()}
        problems = failures(directory, codes)
        if problems:
            raise AssertionError(report(directory, codes, problems))


# ----------------------------------------------------------------------------------------------
# torchrun: each worker is this file, as a launcher that runs the script as a child, records the
# child's exit code and output, and marks the rank done when the script reaches
# destroy_process_group() (everything before it ran without an exception).


def run_torchrun(
    script: str | Path, world: int = 2, timeout: float = 180, teardown_grace: float = TEARDOWN_GRACE
) -> None:
    """Run ``script`` as a user would with ``torchrun --nproc_per_node=world``; raise if it failed."""
    script = Path(script).resolve()
    directory = script.parent / f"{script.stem}-ranks"
    directory.mkdir()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        str(Path(__file__).resolve()),
        str(directory),
        str(script),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    deadline, finished, hung = time.monotonic() + timeout, None, False
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as agent:
        while True:
            try:
                output, _ = agent.communicate(timeout=5)
                break
            except subprocess.TimeoutExpired:
                if finished is None and all(_marker(directory, rank).is_file() for rank in range(world)):
                    finished = time.monotonic()
                hung = finished is not None and time.monotonic() - finished > teardown_grace
                if hung or time.monotonic() > deadline:
                    break
        if agent.returncode is None:
            agent.terminate()  # torchrun stops its workers' process groups on SIGTERM
            try:
                output, _ = agent.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
                output, _ = agent.communicate()
            output += "\ntorchrun hung in teardown" if hung else f"\ntorchrun timed out after {timeout} s"
    codes = {rank: _read_exit(directory, rank) for rank in range(world)}
    if hung:  # every rank had finished its work; those that had not exited hung in torch's teardown
        codes = {rank: HUNG_IN_TEARDOWN if code is None else code for rank, code in codes.items()}
    problems = failures(directory, codes)
    if agent.returncode != 0 and not (hung and not problems):
        problems.insert(0, f"torchrun exit code {agent.returncode}{_signal_name(agent.returncode)}")
    if problems:
        raise AssertionError(report(directory, codes, problems, extra=output))


def _read_exit(directory: Path, rank: int) -> int | None:
    path = _exit_file(directory, rank)
    return int(path.read_text()) if path.is_file() else None


def _launch(directory: Path, script: Path) -> int:
    """torchrun's worker: run the script as a child, keep its exit code and output."""
    rank = int(os.environ["RANK"])
    with open(_log(directory, rank), "w") as log:
        code = subprocess.call(
            [sys.executable, __file__, "--rank", str(directory), str(script)], stdout=log, stderr=subprocess.STDOUT
        )
    _exit_file(directory, rank).write_text(str(code))
    # Exit 0 when this rank finished, so that torchrun does not stop the others before they mark
    # themselves done; exit 1 on a real failure, so that it stops them at once.
    return 0 if code == 0 or (code in ABORT_CODES and _marker(directory, rank).is_file()) else 1


def _run_rank(directory: Path, script: Path) -> None:
    """The rank itself: the script as ``python script`` runs it, marked done at destroy_process_group()."""
    import runpy

    sys.path[0] = str(script.parent)
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    teardown = dist.destroy_process_group

    def destroy_process_group(group: Any = None) -> None:
        if group is None:  # the default group: the end of the script
            mark_done(directory, rank, "reached destroy_process_group()")
        teardown(group)

    dist.destroy_process_group = destroy_process_group
    sys.argv = [str(script)]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        _run_rank(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(_launch(Path(sys.argv[1]), Path(sys.argv[2])))
