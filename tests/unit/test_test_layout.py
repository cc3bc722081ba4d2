"""The test tree's layout: tests/unit mirrors the package, and test modules share code through
tests/helpers (plain functions) or a conftest.py (fixtures), never by importing one another."""

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
UNIT = TESTS / "unit"
PACKAGE = ROOT / "torchtitan_ablate"


def imported_test_modules(source: str) -> list[str]:
    """The names of `source`'s import statements that reach a test_* module (or a test_* name,
    which pytest would collect a second time), absolute or relative."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names = [
                f"{base}.{alias.name}" if node.module else base + alias.name for alias in node.names
            ]
        else:
            continue
        found += [n for n in names if any(p.startswith("test_") for p in n.split("."))]
    return found


def unmirrored(test_file: Path) -> bool:
    """Whether a tests/unit test file sits in a folder the package does not have. Top-level
    files test top-level modules or the whole repository; tests/unit/scripts tests scripts/."""
    folder = test_file.parent.relative_to(UNIT)
    if folder in (Path("."), Path("scripts")):
        return False
    return not (PACKAGE / folder / "__init__.py").is_file()


def test_the_rules_see_a_violation():
    bad = "from tests.unit.components.test_data import loader\nfrom . import test_sft\n"
    bad += "from .test_tokenizer import TEXTS\nimport tests.integration.test_train\n"
    assert len(imported_test_modules(bad)) == 4
    assert imported_test_modules("from tests.helpers.data import loader, rows\n") == []
    assert unmirrored(UNIT / "memory" / "test_estimator.py")
    assert not unmirrored(UNIT / "components" / "data" / "test_data.py")
    assert not unmirrored(UNIT / "scripts" / "test_setup_env.py")


def test_no_test_module_imports_another():
    bad = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted(TESTS.rglob("*.py"))
        for name in imported_test_modules(path.read_text())
    ]
    assert not bad, "move shared code to tests/helpers or a conftest.py fixture:\n" + "\n".join(bad)


def test_unit_tests_mirror_the_package():
    bad = [str(p.relative_to(ROOT)) for p in sorted(UNIT.rglob("test_*.py")) if unmirrored(p)]
    assert not bad, "put each unit test beside the package folder it tests:\n" + "\n".join(bad)


def test_test_file_names_are_unique():
    """No folder of test files is a package (tests/helpers holds none), so pytest imports each
    test file under its own name."""
    assert [p.relative_to(TESTS) for p in TESTS.rglob("__init__.py")] == [
        Path("helpers/__init__.py")
    ]
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [name for name, n in names.items() if n > 1]


def test_the_suite_runs_one_thread_per_process():
    # tests/conftest.py: OpenMP threads spinning on a loaded 2-core machine slowed tests ~8x.
    import torch

    assert torch.get_num_threads() == 1
