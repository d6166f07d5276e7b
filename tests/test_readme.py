"""The README's Python examples run as written, in order, as a new user would paste them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .multiprocess import run_torchrun

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
    """The README's install-and-test lines are .ci/run's, and its extras are pyproject's."""
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    # The first install is the package's with its test extras (the docs extra's comes later).
    install = next(line for line in ci.splitlines() if line.startswith("python -m pip install"))
    assert install.replace('"$constraints"', "constraints.txt") in text
    assert "\npython -m pytest -q\n" in ci and "\npython -m pytest -q\n" in text
    pin = re.search(r'echo "(torch==[^"]+)" >"\$constraints"', ci)
    assert pin and f'echo "{pin.group(1)}" > constraints.txt' in text
    # The first command of the README installs the CPU torch before anything can pull a CUDA one.
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    assert first_block is not None
    lines = first_block.group(1).splitlines()
    assert lines[0].startswith(f"python -m pip install {pin.group(1)} --index-url https://download.pytorch.org/whl/cpu")
    assert lines[1] == 'python -m pip install -e ".[bench]" && python -m benchmarks'


def test_readme_extras_match_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = README.read_text()
    for extra in ("test", "bench", "integration", "monitor", "privacy"):
        names = [re.split(r"[<>=\[ ]", requirement)[0] for requirement in extras[extra]]
        mention = re.search(rf"`{extra}` \(([^)]*)\)", text)
        assert mention, f"the README does not list the {extra} extra"
        assert [n.strip() for n in mention.group(1).split(",")] == names, extra


@pytest.mark.parametrize("index", [0, 1], ids=["ddp", "fsdp2"])
def test_readme_torchrun_examples_run(index: int, tmp_path: Path) -> None:
    scripts = re.findall(r"```python torchrun\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(scripts) == 2
    script = tmp_path / "example.py"
    script.write_text(scripts[index])
    # Every rank must succeed; a SIGABRT passes only after every rank reached destroy_process_group()
    # (torch 2.13's gloo teardown, see tests/multiprocess.py).
    run_torchrun(script, world=2, timeout=180)


def test_contributing_rule_runs_and_is_the_rule_it_describes() -> None:
    import torch
    from torch import nn

    text = (README.parent / "CONTRIBUTING.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert blocks
    namespace: dict[str, object] = {"__name__": "contributing"}
    for block in blocks:
        exec(compile(block, "CONTRIBUTING.md", "exec"), namespace)
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    expected = model.weight.detach() - 0.1 * torch.func.grad(
        lambda w: torch.nn.functional.linear(x, w, model.bias).sum()
    )(model.weight.detach()) / (x.pow(2).mean() + 1e-8)
    optimizer = namespace["InputNormalizedSGD"](model, lr=0.1)  # type: ignore[operator]
    model(x).sum().backward()
    optimizer.step()
    torch.testing.assert_close(model.weight.detach(), expected)
