"""perf/report.py turns perf/results/*.json into perf/REPORT.md and the README's performance
section: every claim once with its result, bad files reported, the rest of the README kept."""

import json
import re
import shutil
from types import SimpleNamespace

import pytest

from tests.perf._run import RESULTS, run_script, script_globals

README_HEAD = """# Project

Intro.

```
## not a heading: inside a code block
```

## Performance

An old, hand-written table.

| claim | target |
| --- | --- |
| something | ≥ 1× |

"""
README_TAIL = """## Development

Keep this section as it is.
"""


@pytest.fixture
def report(monkeypatch):
    """perf/report.py's names (the file run, not imported): its main is the command line."""
    return SimpleNamespace(**script_globals("report.py", monkeypatch))


@pytest.fixture
def setup(tmp_path):
    """A copy of the real results, a README with a Performance section, the CLI's paths."""
    results = tmp_path / "perf" / "results"
    results.mkdir(parents=True)
    for path in RESULTS.glob("*.json"):
        shutil.copy(path, results)
    readme = tmp_path / "README.md"
    readme.write_text(README_HEAD + README_TAIL)
    out = tmp_path / "perf" / "REPORT.md"
    args = ["--results", str(results), "--report", str(out), "--readme", str(readme)]
    return results, out, readme, args


def claims_in(doc, path=""):
    """(path, pass) of every dict with a boolean "pass" below the top level: the test's own
    reading of what a claim is."""
    if isinstance(doc, dict):
        if path and isinstance(doc.get("pass"), bool):
            yield path, doc["pass"]
        for key, value in doc.items():
            yield from claims_in(value, f"{path}.{key}" if path else key)
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from claims_in(value, f"{path}[{i}]")


def table_rows(text):
    """The rows of REPORT.md's claims table."""
    claims = text.split("## Claims\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in claims.splitlines() if line.startswith("| `")]


def performance_section(text):
    return text.split("## Performance\n", 1)[1].split("\n## ", 1)[0]


def test_every_claim_appears_once_with_its_result(report, setup):
    results, out, readme, args = setup
    assert report.main(args) == 0
    rows = table_rows(out.read_text())
    expected = [(f"{p.stem}.{path}", passed) for p in sorted(results.glob("*.json"))
                for path, passed in claims_in(json.loads(p.read_text()))]
    assert len(expected) >= 20
    for key, passed in expected:
        hits = [row for row in rows if row.startswith(f"| `{key}` |")]
        assert len(hits) == 1, key
        assert hits[0].endswith("| pass |" if passed else "| **falls short** |"), hits[0]
    assert len(rows) == len(expected)
    # The README has the claims themselves, once each; REPORT.md's ↳ rows are parts of them.
    section = performance_section(readme.read_text())
    for row in rows:
        assert section.count(row) == (0 if "↳" in row else 1), row
    assert "prefix_reuse.turns[7]" not in section and "prefix_reuse.claim" in section


def test_known_claims_show_their_figures(report, setup):
    _, out, _, args = setup
    report.main(args)
    text = out.read_text()
    row = next(r for r in table_rows(text) if r.startswith("| `kv.demote_to_disk` |"))
    kv = json.loads((RESULTS / "kv.json").read_text())["demote_to_disk"]
    assert f"{kv['ratio']:.2f}×" in row and f"{kv['baseline']['median']:,.0f} MiB/s" in row
    assert "Where and when" in text and "| `kv` |" in text and "ext4" in text


def test_a_corrupt_or_missing_json_is_reported_not_fatal(report, setup):
    results, out, readme, args = setup
    (results / "kv.json").write_text('{"benchmark": "kv", "demote_to_disk": ')
    (results / "decode.json").unlink()
    (results / "extra.json").write_text("[1, 2]")
    assert report.main(args) == 0
    text = out.read_text()
    problems = text.split("## Missing, unreadable or unexpected results", 1)[1]
    assert re.search(r"`kv` .*unreadable: JSONDecodeError", problems)
    assert re.search(r"`decode` .*missing", problems)
    assert re.search(r"`extra` .*not a JSON object", problems)
    assert not any(r.startswith(("| `kv.", "| `decode.")) for r in table_rows(text))
    assert any(r.startswith("| `scheduler.per_hop` |") for r in table_rows(text))
    intro = " ".join(performance_section(readme.read_text()).split())  # the words, unwrapped
    assert "No result from `kv` (unreadable), `decode` (missing), `extra` (unreadable)." in intro


def test_the_readme_section_is_replaced_and_the_rest_kept(report, setup):
    _, _, readme, args = setup
    for _ in range(2):  # and a second run changes nothing
        report.main(args)
        text = readme.read_text()
        head, tail = README_HEAD.split("## Performance\n")[0], README_TAIL
        assert text.startswith(head + "## Performance\n\n") and text.endswith("\n\n" + tail)
        section = performance_section(text)
        assert "hand-written" not in section and "| something |" not in section
        assert "generated by `make bench`" in section and "2-CPU" in section
        assert "```python" not in section  # tests/test_readme.py runs the README's python


def test_unknown_and_changed_claims_get_generic_rows(report, setup):
    results, out, _, args = setup
    doc = json.loads((results / "transport.json").read_text())
    doc["zero_copy"] = {"unit": "ms", "target": 20.0, "measured": {"median": 0.5},
                        "baseline": {"median": 21.0}, "ratio": 42.0, "pass": True,
                        "note": "a claim report.py has no row for; more after the semicolon"}
    del doc["latency"]["socket_ratio"]  # a known claim whose layout changed
    (results / "transport.json").write_text(json.dumps(doc))
    assert report.main(args) == 0
    text = out.read_text()
    rows = {r.split(" | ")[0]: r for r in table_rows(text)}
    assert rows["| `transport.zero_copy`"] == (
        "| `transport.zero_copy` | zero copy: a claim report.py has no row for | 20 | "
        "42× (0.5 ms) | 21.0 ms | pass |")
    verdict = "pass" if doc["latency"]["pass"] else "**falls short**"
    assert rows["| `transport.latency`"].endswith(f"| {verdict} |")
    assert re.search(r"`transport.latency`: not in the layout .*socket_ratio", text)


def test_check_detects_a_stale_report_or_readme(report, setup, monkeypatch, capsys):
    results, out, readme, args = setup
    status, said, _ = run_script("report.py", args, monkeypatch, capsys)  # as `make bench`
    assert status == 0 and "written" in said
    assert report.main([*args, "--check"]) == 0
    (results / "cluster.png").write_bytes(b"png")  # plots are not compared
    assert report.main([*args, "--check"]) == 0
    before = out.read_text(), readme.read_text()

    doc = json.loads((results / "scheduler.json").read_text())
    doc["throughput"]["pass"] = not doc["throughput"]["pass"]
    (results / "scheduler.json").write_text(json.dumps(doc))
    status, _, err = run_script("report.py", [*args, "--check"], monkeypatch, capsys)
    assert status == 1 and "out of date" in err
    assert (out.read_text(), readme.read_text()) == before  # --check writes nothing

    report.main(args)
    assert report.main([*args, "--check"]) == 0
    assert "[`cluster`](results/cluster.png)" in out.read_text()
    readme.write_text(readme.read_text().replace("| pass |", "| PASS |", 1))
    assert report.main([*args, "--check"]) == 1


def test_a_shared_memory_claim_in_transport_gets_its_row(report, setup):
    """perf/transport.py's coming third claim (the layout `perf._common.claim` writes)."""
    results, out, _, args = setup
    doc = json.loads((results / "transport.json").read_text())
    doc["shared_memory"] = {"unit": "ms", "target": 20.0, "measured": {"median": 1.25},
                            "baseline": {"median": 61.0}, "ratio": 48.8, "pass": True,
                            "usable": {"median": 0.4}, "note": "ms per fetch"}
    (results / "transport.json").write_text(json.dumps(doc))
    report.main(args)
    text = out.read_text()
    row = next(r for r in table_rows(text) if r.startswith("| `transport.shared_memory` |"))
    assert "≥ 20× faster than over TCP | 49× (1.25 ms) |" in row and row.endswith("| pass |")
    assert "not in the layout" not in text


def test_odd_shapes_do_not_stop_the_report(report, setup):
    results, out, _, args = setup
    (results / "odd.json").write_text(json.dumps({
        "env": 5, "params": [], "x": {"pass": True, "ratio": "a", "measured": {"runs": [1]},
                                       "note": 7, "inner": {"pass": False}}}))
    doc = json.loads((results / "kv.json").read_text())
    doc["promote_from_disk"]["warm"] = {"ratio": 1.5, "pass": True}  # unknown, nested
    (results / "kv.json").write_text(json.dumps(doc))
    assert report.main(args) == 0
    keys = [r.split(" | ")[0] for r in table_rows(out.read_text())]
    odd = keys.index("| `odd.x`")
    assert keys[odd + 1] == "| `odd.x.inner`"
    at = keys.index("| `kv.promote_from_disk`")
    assert keys[at + 1] == "| `kv.promote_from_disk.warm`"
    assert "| `kv.promote_from_disk.warm` | ↳ promote from disk.warm | — | 1.50× |" in (
        out.read_text())
