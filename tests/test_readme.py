"""The README's example is real code: it must run and print what a reader expects."""

import pathlib
import re
import subprocess
import sys
import textwrap

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    example = tmp_path / "example.py"
    example.write_text(blocks[0])
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("{'reply': 'hello: omni runs pipelines', "
                                  "'words': ['omni', 'runs', 'pipelines']}")


def test_readme_shows_the_two_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text


def test_every_readme_python_block_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    for i, block in enumerate(blocks[1:], start=1):
        example = tmp_path / f"block{i}.py"
        example.write_text(textwrap.dedent(block))  # a block inside a list item is indented
        out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
        assert out.returncode == 0, f"README python block {i}: {out.stderr}"


def test_the_examples_graphs_in_the_readme_are_what_omni_graph_show_prints():
    import subprocess
    import sys

    text = README.read_text()
    for example in ("omni_dialogue", "image_generation"):
        shown = subprocess.run([sys.executable, "-m", "cli", "graph", "show",
                                f"examples/{example}.py", "--format", "mermaid"],
                               cwd=README.parent, capture_output=True, text=True, check=True)
        assert f"```mermaid\n{shown.stdout.strip()}\n```" in text, example
