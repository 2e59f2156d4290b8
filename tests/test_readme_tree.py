"""The README's "How it is built" tree names every module of src/fedswarm
and netsim, so a newcomer can find each room from it."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tree() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"## How it is built\n\n```\n(.*?)```", text, re.S)
    assert m, "README has no 'How it is built' tree"
    return m.group(1)


def test_the_readme_tree_names_every_module_and_package() -> None:
    tree = _tree()
    words = set(re.findall(r"[A-Za-z_][\w.]*", tree))
    missing = []
    pkg = ROOT / "src" / "fedswarm"
    for p in sorted(pkg.rglob("*.py")):
        if p.name == "__init__.py" and p.parent != pkg:
            if f"{p.parent.name}/" not in tree:
                missing.append(str(p.parent.relative_to(pkg)) + "/")
        elif p.name != "__init__.py" and p.name not in words:
            missing.append(str(p.relative_to(pkg)))
    for p in sorted((ROOT / "netsim").glob("*.py")):
        if p.name not in ("__init__.py", "__main__.py") and p.name not in words:
            missing.append("netsim/" + p.name)
    assert missing == []


def test_the_readme_tree_names_no_module_that_is_gone() -> None:
    tree = _tree()
    named = set(re.findall(r"\b([a-z_]+\.py)\b", tree))
    have = {p.name for p in (ROOT / "src" / "fedswarm").rglob("*.py")} | {p.name for p in (ROOT / "netsim").glob("*.py")}
    assert sorted(named - have) == []
