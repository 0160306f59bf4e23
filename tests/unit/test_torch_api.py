"""The torch internals shmloader relies on are checked once, at import, and
named with the torch version where one is missing (shmloader/_main/_torch_api.py)."""

import ast
import re
import subprocess
import sys

import pytest
import torch

from shmloader import DataLoader
from shmloader._main import _torch_api
from tests.helpers import ROOT
from tests.helpers.datasets import Images

PACKAGE = ROOT / "shmloader"


def _private_torch_imports():
    """(module, name) of every `from torch... import name` in shmloader's
    sources where the module path or the name is private."""
    found = set()
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                for alias in node.names:
                    if "._" in node.module or alias.name.startswith("_"):
                        found.add((node.module, alias.name))
    return found


def test_every_private_torch_name_imported_is_checked_at_import():
    assert _private_torch_imports() - set(_torch_api._NEEDED) == set()


@pytest.mark.slow
def test_a_torch_without_a_name_shmloader_needs_fails_at_import_naming_it():
    script = (
        "import torch.utils.data.dataloader as d\ndel d._BaseDataLoaderIter\nimport shmloader\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=PACKAGE.parent,
        timeout=120,
    )
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "ImportError: shmloader needs torch.utils.data.dataloader._BaseDataLoaderIter"
    ), last
    assert f"torch {torch.__version__} does not have" in last and _torch_api.SUPPORTED in last


def test_an_iterator_missing_an_attribute_torch_sets_is_named(monkeypatch):
    monkeypatch.setattr(
        _torch_api,
        "ITERATOR_ATTRIBUTES",
        _torch_api.ITERATOR_ATTRIBUTES + ("_attribute_of_another_torch",),
    )
    with pytest.raises(
        RuntimeError,
        match=r"needs _BaseDataLoaderIter\._attribute_of_another_"
        rf"torch, which torch {re.escape(torch.__version__)} does not",
    ):
        iter(DataLoader(Images(8), batch_size=4, num_workers=2))


def test_the_declared_torch_range_is_the_one_checked():
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    assert _torch_api.SUPPORTED in project["dependencies"]
