"""The structure docs/design.md §2 describes: imports go one way, and family names are compared only where a
component dispatches on them."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"plugins": ("runtime", "export"), "runtime": ("export",)}


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):  # module-level and lazy (function-level) imports alike
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_go_one_way(package):
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in sorted((ROOT / package).rglob("*.py"))
           for line, mod in _imports(p) if mod.split(".")[0] in FORBIDDEN[package]]
    assert not bad, "\n".join(bad)


NAMES = {"dflash", "pard", "eagle3"}
ALLOWED = ("export/families/",)  # the family modules themselves


def _family_literal(node) -> bool:
    if isinstance(node, ast.Constant) and node.value in NAMES:
        return True
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_family_literal(e) for e in node.elts)


def _family_tests(path: Path) -> list[int]:
    """Lines comparing with a family-name literal (==, !=, in) or indexing with one (``table["dflash"]``)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and any(map(_family_literal, [node.left, *node.comparators])):
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and _family_literal(node.slice):
            lines.append(node.lineno)
    return lines


def test_no_family_string_comparisons_outside_the_family_modules():
    hits = []
    for package in ("export", "runtime", "plugins", "scripts"):
        for p in sorted((ROOT / package).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if not rel.startswith(ALLOWED):
                text = p.read_text().splitlines()
                hits += [f"{rel}:{i}: {text[i - 1].strip()}" for i in _family_tests(p)]
    assert not hits, "compare plugins.rule.Family members or ask the family object instead:\n" + "\n".join(hits)


def test_the_family_check_finds_a_comparison(tmp_path):
    f = tmp_path / "x.py"
    f.write_text('a = family == "pard"\nb = {"dflash": 1}["dflash"]\nc = "dflash"  # a name, not a test\n')
    assert _family_tests(f) == [1, 2]
