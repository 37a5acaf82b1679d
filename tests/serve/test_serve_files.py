"""A remote client never names a server path: a graph's file inputs over HTTP (in process,
through httpx's ASGI transport). Input files only under a folder the operator allows, with
one refusal whatever the path; output files placed by the server, sent back as data, their
folder gone afterwards."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Annotated

import httpx
import pytest

import omni
from omni.serve import FilePolicy, build_app


@omni.node(thread=True)
def read_text(path: str) -> str:
    return Path(path).read_text() if path else ""


@omni.node(thread=True)
def write_text(path: str, text: str) -> dict:
    Path(path).write_text(text.upper())
    return {"written": path, "nested": [path, "other"]}


@omni.graph
def copy(text: str, source: Annotated[str, omni.InputFile()] = "",
         out: Annotated[str, omni.OutputFile(".txt")] = ""):
    return {"read": read_text(source), "report": write_text(out, text)}


@omni.node(thread=True)
def read_path(path: Path) -> str:
    return path.read_text()


@omni.graph
def by_path(source: Path):
    return read_path(source)


@pytest.fixture
def allowed(tmp_path: Path) -> Path:
    folder = tmp_path / "allowed"
    folder.mkdir()
    (folder / "note.txt").write_text("inside")
    (tmp_path / "secret.txt").write_text("outside")
    (folder / "escape").symlink_to(tmp_path / "secret.txt")
    return folder


async def post(policy: FilePolicy, graph: str, inputs: dict, *, stream: bool = False
               ) -> httpx.Response:
    async with omni.Runtime(graphs=[copy, by_path]) as rt:
        app = build_app(rt, {"copy": copy, "by_path": by_path}, files=policy)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://omni") as http:
            return await http.post(f"/v1/graphs/{graph}",
                                   json={"inputs": inputs, "stream": stream})


async def test_without_an_allowed_folder_no_input_file_is_opened(allowed: Path) -> None:
    answers = [await post(FilePolicy(), graph, {"text": "x", "source": path}
                          if graph == "copy" else {"source": path})
               for graph in ("copy", "by_path")
               for path in (str(allowed / "note.txt"), "/etc/shadow", "/no/such/file")]
    assert {a.status_code for a in answers} == {400}
    messages = {a.json()["error"]["message"] for a in answers}
    assert len(messages) == 1  # one message whatever the path: no existence oracle
    assert "opens no file its clients name" in messages.pop()


async def test_an_allowed_folder_opens_files_inside_it_only(allowed: Path) -> None:
    policy = FilePolicy.create([allowed])
    inside = await post(policy, "copy", {"text": "x", "source": "note.txt"})
    assert inside.status_code == 200 and inside.json()["read"] == "inside"
    assert (await post(policy, "by_path", {"source": str(allowed / "note.txt")})
            ).json() == {"output": "inside"}
    refused = [await post(policy, "copy", {"text": "x", "source": source})
               for source in ("../secret.txt", str(allowed.parent / "secret.txt"), "escape",
                              "/etc/shadow", "/no/such/file", "a\x00b")]
    assert {a.status_code for a in refused} == {400}
    assert len({a.json()["error"]["message"] for a in refused}) == 1
    assert "under a folder this server allows" in refused[0].json()["error"]["message"]


async def test_a_client_naming_an_output_file_is_refused_and_nothing_is_written(
        tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    for out in (str(victim), str(tmp_path / "new" / "a" / "b.txt")):
        answer = await post(FilePolicy(), "copy", {"text": "x", "out": out})
        assert answer.status_code == 400
        assert "the server picks where" in answer.json()["error"]["message"]
    assert victim.read_text() == "precious" and not (tmp_path / "new").exists()


async def test_output_files_come_back_as_data_and_their_folder_goes(tmp_path: Path) -> None:
    root = tmp_path / "outputs"
    root.mkdir()
    answer = await post(FilePolicy.create([], root), "copy", {"text": "hello"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    sent = body["files"]["out"]
    assert sent["filename"] == "out.txt" and sent["bytes"] == 5
    assert base64.b64decode(sent["data"]) == b"HELLO"
    # the answer names the file, never the server's path to it
    assert body["report"] == {"written": "out.txt", "nested": ["out.txt", "other"]}
    assert str(root) not in answer.text and os.listdir(root) == []


async def test_a_stream_sends_the_output_files_before_done(tmp_path: Path) -> None:
    answer = await post(FilePolicy.create([], tmp_path), "copy", {"text": "abc"}, stream=True)
    data = [line.removeprefix("data: ") for line in answer.text.splitlines()
            if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    files = json.loads(data[-2])["files"]
    assert base64.b64decode(files["out"]["data"]) == b"ABC"
    assert os.listdir(tmp_path) == []


def test_a_policy_names_a_folder_that_is_not_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a folder"):
        FilePolicy.create([tmp_path / "missing"])


def test_file_roles_come_from_annotations() -> None:
    from omni.graph import file_role

    assert file_role(Annotated[str, omni.InputFile()]) == omni.InputFile()
    assert file_role(Annotated[str, omni.OutputFile(".wav")]) == omni.OutputFile(".wav")
    assert file_role(Path) == omni.InputFile() and file_role(Path | None) == omni.InputFile()
    assert file_role(str) is None and file_role(Annotated[int, "x"]) is None
    with pytest.raises(ValueError, match="suffix"):
        omni.OutputFile("wav")
