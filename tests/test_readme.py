"""The README's example is real code: it must run and print what a reader expects. Each block
runs in this process as a script would (`runpy`, as ``__main__``, in a folder of its own)."""

import pathlib
import re
import runpy
import textwrap

from tests._cli import run_omni

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def run_block(path: pathlib.Path, monkeypatch) -> None:
    with monkeypatch.context() as patch:
        patch.chdir(path.parent)
        patch.setattr("sys.argv", [str(path)])
        runpy.run_path(str(path), run_name="__main__")


def test_readme_example_runs(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    example = tmp_path / "example.py"
    example.write_text(blocks[0])
    run_block(example, monkeypatch)
    assert capsys.readouterr().out.strip() == ("{'reply': 'hello: omni runs pipelines', "
                                               "'words': ['omni', 'runs', 'pipelines']}")


def test_readme_shows_the_two_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text


def test_every_readme_python_block_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    for i, block in enumerate(blocks[1:], start=1):
        example = tmp_path / f"block{i}" / "example.py"
        example.parent.mkdir()
        example.write_text(textwrap.dedent(block))  # a block inside a list item is indented
        try:
            run_block(example, monkeypatch)
        except Exception as exc:
            raise AssertionError(f"README python block {i} failed: {exc!r}") from exc


def test_the_examples_graphs_in_the_readme_are_what_omni_graph_show_prints():
    text = README.read_text()
    for example in ("omni_dialogue", "image_generation"):
        shown = run_omni("graph", "show", f"examples/{example}.py", "--format", "mermaid")
        assert shown.returncode == 0, shown.stderr
        assert f"```mermaid\n{shown.stdout.strip()}\n```" in text, example
