"""The README's reliability section lists exactly the cases the suite defines, and each case
is recorded by a test: checked from the source, without running the suite (cheap)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.reliability.cases import CASES, ELSEWHERE
from tests.reliability.recorder import Row
from tests.reliability.table import (
    HEADING,
    README,
    ROOT,
    render,
    section,
    table_cases,
    write_readme,
)

HERE = Path(__file__).resolve().parent


def test_the_readme_table_lists_exactly_the_suites_cases():
    rows = table_cases(README.read_text())
    assert rows == [(c.area, c.case) for c in CASES.values()], (
        "README.md's reliability table is out of date: run `python -m tests.reliability.table`")


def test_each_case_is_recorded_by_one_test_and_each_record_names_a_case():
    used: list[str] = []
    for path in sorted(HERE.glob("test_*.py")):
        used += re.findall(r'record\(\s*"([^"]+)"', path.read_text())
    assert sorted(used) == sorted(CASES)  # each once


def test_the_tests_covering_other_faults_exist_and_are_listed():
    start, end = section(README.read_text())
    body = README.read_text()[start:end]
    for what, node in ELSEWHERE:
        path, name = node.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), node
        assert f"`{node}`" in body and what in body


def test_render_gives_a_section_the_check_reads_back(tmp_path):
    rows = [Row(key, c.area, c.case, 1, "fine") for key, c in CASES.items()]
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{HEADING}\n\nSTALE-BODY\n\n## Next\n\ntext\n")
    write_readme(render(rows[::-1]), readme)
    text = readme.read_text()
    assert table_cases(text) == [(c.area, c.case) for c in CASES.values()]
    assert "STALE-BODY" not in text and text.endswith("## Next\n\ntext\n")
