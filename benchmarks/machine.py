"""The machine a run measured, the process memory probes (glibc heap, resident set), and torch's profiler
without Kineto's notices."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import inputaware_optim

__all__ = ["allocated_bytes", "describe", "has_allocation_probe", "profiled", "resident_bytes"]


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _load_mallinfo2() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    mallinfo2 = getattr(ctypes.CDLL(name), "mallinfo2", None)  # glibc >= 2.33
    if mallinfo2 is not None:
        mallinfo2.restype = _Mallinfo2
    return mallinfo2


_MALLINFO2 = _load_mallinfo2()


def has_allocation_probe() -> bool:
    """Whether ``allocated_bytes`` works here (glibc with ``mallinfo2``)."""
    return _MALLINFO2 is not None


def allocated_bytes() -> int:
    """Bytes the C heap has handed out and not freed (``uordblks + hblkhd``): torch's CPU tensors live here.

    Raises:
        RuntimeError: Without glibc's ``mallinfo2``.
    """
    if _MALLINFO2 is None:
        raise RuntimeError("allocated_bytes needs glibc >= 2.33 (mallinfo2)")
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


def resident_bytes() -> int:
    """The resident set size of this process, from ``/proc/self/statm``."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def profiled(**options: Any) -> Iterator[torch.profiler.profile]:
    """``torch.profiler.profile(**options)``, without the ``USDT:`` line Kineto prints at each start and stop.

    Kineto (torch 2.13) writes ``USDT:... profiler_start`` and ``profiler_stop`` to the process's
    stderr every time a profiler starts or stops. ``KINETO_LOG_LEVEL`` cannot drop them alone: USDT
    ranks above ERROR, so a level that hides them hides errors as well. So only while the profiler
    starts and stops, file descriptor 2 goes to a file, and every line of it but those is written
    back to ``sys.stderr``: a warning or an error from the profiler still shows.
    """
    profiler = torch.profiler.profile(**options)
    with _native_stderr_without_usdt():
        profiler.__enter__()
    try:
        yield profiler
    finally:
        with _native_stderr_without_usdt():
            profiler.__exit__(None, None, None)


@contextmanager
def _native_stderr_without_usdt() -> Iterator[None]:
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines = sink.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not line.startswith("USDT:"))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}{' (with uncommitted changes)' if dirty else ''}"


def describe() -> dict[str, Any]:
    """The CPU, cores, memory, software versions and thread settings of this process."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "cpus_available": affinity,
        "memory_bytes": _memory_total(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "inputaware_optim": inputaware_optim.__version__,
        "git_commit": _git_commit(),
    }
