"""The README's Python examples run as written, in order, as a new user would paste them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    # ```python blocks are runnable; ```py blocks are sketches (torchrun scripts, placeholders).
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_examples_run(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = python_blocks()
    assert len(blocks) >= 8
    namespace: dict[str, object] = {"__name__": "readme"}
    for index, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md python block {index}", "exec"), namespace)
        except Exception as error:  # pragma: no cover - the message says which block broke
            raise AssertionError(f"README python block {index} failed:\n{block}") from error
    assert "torch.Size([4, 10])" in capsys.readouterr().out


def test_readme_commands_match_ci() -> None:
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    command = 'python -m pip install -e ".[test,bench]" && python -m pytest -q'
    assert command in text and command in ci
    assert 'python -m pip install -e ".[bench]" && python -m benchmarks' in text.split("\n## ")[0]


@pytest.mark.parametrize("index", [0, 1], ids=["ddp", "fsdp2"])
def test_readme_torchrun_examples_run(index: int, tmp_path: Path) -> None:
    scripts = re.findall(r"```python torchrun\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(scripts) == 2
    script = tmp_path / "example.py"
    script.write_text(scripts[index])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
