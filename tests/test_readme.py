"""The README, a landing page: its Python examples run as pasted, each on its own, and what it says
about installing and about the repository is true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    # ```python blocks are runnable; ```py blocks would be sketches.
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_example_runs_on_its_own(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    """Each block in a fresh namespace, as a reader pastes just that one; each prints its result."""
    block = python_blocks()[index]
    try:
        exec(compile(block, f"README.md python block {index}", "exec"), {"__name__": "readme"})
    except Exception as error:  # pragma: no cover - the message says which block broke
        raise AssertionError(f"README python block {index} failed:\n{block}") from error
    out = capsys.readouterr().out
    assert out.strip(), f"README python block {index} prints nothing"
    if index == 0:  # the drop-in trains exactly as the stock optimizer it replaces
        losses = re.findall(r"loss (\S+) in", out)
        assert len(losses) == 2 and losses[0] == losses[1], out


def test_readme_has_the_three_examples() -> None:
    blocks = python_blocks()
    assert len(blocks) == 3
    assert "InputAwareAdamW" in blocks[0]
    assert "class InputNormalization(Rule)" in blocks[1] and "rules=[InputNormalization()]" in blocks[1]
    assert "base=" in blocks[2] and "Monitor(" in blocks[2]


def test_readme_is_a_landing_page_whose_links_exist() -> None:
    text = README.read_text()
    assert len(text.encode()) <= 16_000, "the README is a landing page: move details to docs/"
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link.split("#")[0] for link in links if not re.match(r"[a-z]+://", link)]
    assert local
    for target in local:
        assert (README.parent / target).exists(), f"README links to {target}, which does not exist"


def test_readme_commands_match_ci() -> None:
    """The README's install-and-test lines are .ci/run's, and its extras are pyproject's."""
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    # The first install is the package's with its test extras (the docs extra's comes later).
    install = next(line for line in ci.splitlines() if line.startswith("python -m pip install"))
    assert install.replace('"$constraints"', "constraints.txt") in text
    # The default run (the tests not marked slow), then the slow ones: each a line of its own.
    for run in ("python -m pytest -q", "python -m pytest -q -m slow"):
        assert f"\n{run}\n" in ci and f"\n{run}\n" in text, run
    pin = re.search(r'echo "(torch==[^"]+)" >"\$constraints"', ci)
    assert pin and f'echo "{pin.group(1)}" > constraints.txt' in text
    # The first command of the README installs the CPU torch before anything can pull a CUDA one.
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    assert first_block is not None
    lines = first_block.group(1).splitlines()
    assert lines[0].startswith(f"python -m pip install {pin.group(1)} --index-url https://download.pytorch.org/whl/cpu")
    assert f"a GPU machine: python -m pip install {pin.group(1)}" in lines[0]
    assert lines[1] == 'python -m pip install -e ".[bench]" && python -m benchmarks'


def test_readme_extras_match_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = README.read_text()
    for extra in ("test", "bench", "integration", "monitor", "privacy", "docs"):
        names = [re.split(r"[<>=\[ ]", requirement)[0] for requirement in extras[extra]]
        mention = re.search(rf"`{extra}` \(([^)]*)\)", text)
        assert mention, f"the README does not list the {extra} extra"
        assert [n.strip() for n in mention.group(1).split(",")] == names, extra


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
    from inputaware_optim import InputAwareSGD

    optimizer = InputAwareSGD(model, rules=[namespace["InputNormalization"]()], lr=0.1)  # type: ignore[operator]
    model(x).sum().backward()
    optimizer.step()
    torch.testing.assert_close(model.weight.detach(), expected)
