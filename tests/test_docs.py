"""The documentation site's pages (docs/): their code runs, and what they copy from code is current.

Each page's ```python blocks run in order in a fresh namespace, as a reader pastes one page into
one session. ```py blocks are sketches, except the torchrun scripts (a first line ``# name.py --
run with: torchrun ...``), which run under torchrun with 2 ranks. ``mkdocs build --strict`` runs in
.ci/run (it needs the ``docs`` extra).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from inputaware_optim.coverage import supported_layers_table

from .multiprocess import run_torchrun

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PYTHON = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
SKETCH = re.compile(r"^```py\n(.*?)^```", re.DOTALL | re.MULTILINE)
TORCHRUN = re.compile(r"# \S+\.py -- run with: torchrun --nproc_per_node=2 \S+\.py\n")


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def page_id(page: Path) -> str:
    return page.relative_to(DOCS).as_posix()


PAGES_WITH_CODE = [page for page in pages() if PYTHON.search(page.read_text())]
TORCHRUN_SCRIPTS = [
    (page, block) for page in pages() for block in SKETCH.findall(page.read_text()) if TORCHRUN.match(block)
]


def test_the_guide_pages_have_code() -> None:
    """A page renamed or a fence mistyped would silently leave its code untested."""
    names = {page_id(page) for page in PAGES_WITH_CODE}
    expected = {"quickstart.md", "capture.md", "writing-a-rule.md", "monitoring.md", "training-stack.md", "dp.md"}
    expected |= {f"rules/{rule}.md" for rule in ("index", "foof", "nlms", "lazy-adamw", "kfac", "eva")}
    expected |= {"integrations/lightning.md", "integrations/hugging-face.md"}
    assert expected <= names, sorted(expected - names)
    assert len(TORCHRUN_SCRIPTS) == 3  # training-stack.md: DDP, FSDP2, tensor parallelism


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=page_id)
def test_page_python_blocks_run_in_order(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if page_id(page).startswith("integrations/lightning"):
        pytest.importorskip("lightning")
    if page_id(page).startswith("integrations/hugging-face"):
        pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)  # a block that writes a file writes it here
    namespace: dict[str, object] = {"__name__": "docs"}
    for index, block in enumerate(PYTHON.findall(page.read_text())):
        try:
            exec(compile(block, f"{page_id(page)} python block {index}", "exec"), namespace)
        except Exception as error:  # pragma: no cover - the message says which block broke
            raise AssertionError(f"{page_id(page)}: python block {index} failed:\n{block}") from error


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(TORCHRUN_SCRIPTS)), ids=lambda i: page_id(TORCHRUN_SCRIPTS[i][0]) + f"-{i}")
def test_torchrun_scripts_run(index: int, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(TORCHRUN_SCRIPTS[index][1])
    # Every rank must succeed; a SIGABRT passes only after every rank reached destroy_process_group()
    # (torch 2.13's gloo teardown, see tests/multiprocess.py).
    run_torchrun(script, world=2, timeout=180)


def test_supported_layers_page_is_the_registrys_table() -> None:
    text = (DOCS / "supported-layers.md").read_text()
    found = re.search(r"<!-- supported-layers:[^\n]*-->\n(.*?)\n<!-- end supported-layers -->", text, re.DOTALL)
    assert found, "docs/supported-layers.md lost its supported-layers markers"
    assert found.group(1) == supported_layers_table(), (
        "docs/supported-layers.md's table is stale: paste the output of "
        "python -c 'from inputaware_optim.coverage import supported_layers_table as t; print(t())'"
    )


def test_included_files_exist_and_nav_lists_every_page() -> None:
    """The pages that include a file of the repository (pymdownx.snippets), and mkdocs.yml's nav."""
    for page in pages():
        for included in re.findall(r'^--8<-- "([^"]+)"$', page.read_text(), flags=re.MULTILINE):
            assert (ROOT / included).is_file(), f"{page_id(page)} includes {included}, which is gone"
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in pages():
        assert f": {page_id(page)}\n" in nav, f"{page_id(page)} is not in mkdocs.yml's nav"
    assert (DOCS / "benchmarks" / "results").resolve() == ROOT / "benchmarks" / "results"
