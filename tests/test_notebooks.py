"""The walkthroughs in notebooks/: valid, committed as run top to bottom on a GPU, without errors.

``scripts/run_notebooks.py`` executes them with nbclient on a GPU machine and
writes the executed copies to commit here.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
EXPECTED = ["01_share_an_array", "02_events_and_pipelines", "03_multiprocessing", "04_performance"]


def test_the_walkthroughs_are_all_there():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_valid_and_any_run_was_top_to_bottom_without_errors(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    # Committed with the outputs of a real run: every cell once, in order.
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), \
        f"{path.name}: commit the copy executed by scripts/run_notebooks.py, every cell run once, in order"
    assert any(c.outputs for c in code), f"{path.name}: no outputs"
    for cell in code:
        errors = [o for o in cell.outputs if o.output_type == "error"]
        assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_workers_live_in_a_module(path):
    # A spawned process cannot import a function defined in a notebook cell.
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            defined = [n.name for n in ast.parse(cell.source).body if isinstance(n, ast.FunctionDef)]
            assert not defined, f"{path.name} defines {defined}: put them in nb_workers.py"
