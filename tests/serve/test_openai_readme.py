"""The README's "Serve it" examples work as written against ``omni serve
examples/omni_dialogue.py``: its ``sh`` and ``py`` blocks (which tests/test_readme.py leaves
alone: they need a server) run here, against a real one, with its URL for localhost:8000."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serve._server import ROOT

# The README's own client code against the real command: curl, and the official client in an
# interpreter of its own, each over real HTTP to one ``omni serve`` process of this module.
pytestmark = pytest.mark.proc

README = ROOT / "README.md"
SECTION = "### Serve it"


def blocks(language: str) -> list[str]:
    text = README.read_text()
    start = text.index(SECTION)
    section = text[start:text.index("\n## ", start)]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


@pytest.fixture(scope="module")
def url(serve) -> str:
    return serve(ROOT / "examples" / "omni_dialogue.py")


def test_the_curl_example_answers_a_chat_completion_from_a_real_server(url: str) -> None:
    (block,) = blocks("sh")
    done = subprocess.run(["bash", "-c", block.replace("http://localhost:8000", url)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] >= 1


def test_the_openai_client_example_in_its_own_interpreter_reports_cached_tokens(
        url: str, tmp_path: Path) -> None:
    (block,) = blocks("py")
    script = tmp_path / "client.py"
    script.write_text(block.replace("http://localhost:8000", url))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    cached = re.search(r"cached prompt tokens: (\d+)\n$", done.stdout)
    assert cached and int(cached[1]) > 0, done.stdout
