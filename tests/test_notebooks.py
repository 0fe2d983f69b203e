"""The walkthroughs in notebooks/ are well-formed and follow the pattern spawned workers need.

They are executed, top to bottom, by ``scripts/run_notebooks.py`` on a GPU machine.
"""

from __future__ import annotations

import ast
import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_walkthroughs():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_clean_and_defines_no_workers(path):
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        assert not cell["outputs"] and cell["execution_count"] is None, "commit notebooks without outputs"
        tree = ast.parse(source)
        # A spawned process cannot import a function defined in a notebook: workers live in a module.
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Lambda))], source
