"""A user's mistakes at the command line, as a hostile user makes them: KV flags naming files,
devices, forbidden or impossible places; a node failing as it starts; a bad or missing token
file; inputs that do not fit the graph's annotations; the README naming files that do not exist.
Each is one ``error:`` line naming the flag, node, file or input and the cause, with the right
exit status, nothing run, and no traceback."""

from __future__ import annotations

import re
import subprocess
import textwrap
from pathlib import Path

from tests._cli import run_omni

ROOT = Path(__file__).resolve().parents[2]

KV_GRAPH = textwrap.dedent('''
    import torch
    import omni
    from omni.kv import KVLayout

    KV_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, page_size=16,
                         dtype=torch.float32)

    @omni.node
    async def touch(x: int) -> int:
        open("ran", "w").close()
        return x

    @omni.graph
    def kv(x: int):
        return touch(x)
''')

STARTS_BADLY = textwrap.dedent('''
    import omni

    @omni.node
    class Model:
        async def __aenter__(self):
            raise FileNotFoundError(f"no weights for {omni.context().node}")

        async def __aexit__(self, *exc_info):
            pass

        async def __call__(self, x: int) -> int:
            return x

    @omni.graph
    def starts(x: int):
        return Model()(x)
''')

TYPED = textwrap.dedent('''
    import dataclasses
    from typing import Annotated, Literal
    import msgspec
    import omni

    @dataclasses.dataclass
    class Turn:
        text: str
        repeat: Annotated[int, msgspec.Meta(ge=1)] = 1

    @omni.node
    async def say(turn: Turn, voice: Literal["a", "b"], speed: float) -> str:
        open("ran", "w").close()
        return turn.text

    @omni.graph
    def typed(turn: Turn, voice: Literal["a", "b"] = "a", speed: float = 1.0):
        return say(turn, voice, speed)
''')


def omni_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_omni(*args, cwd=cwd, env={"XDG_CACHE_HOME": str(cwd / "cache")})


def one_error_line(done: subprocess.CompletedProcess[str], status: int, fragment: str) -> None:
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert done.returncode == status and len(lines) == 1, (done.returncode, lines[-5:])
    assert lines[0].startswith("error: ") and fragment in lines[0], lines
    assert done.stdout == ""


def test_command_line_mistakes_are_one_line(tmp_path, record):
    (tmp_path / "kv.py").write_text(KV_GRAPH)
    (tmp_path / "starts.py").write_text(STARTS_BADLY)
    (tmp_path / "afile").write_text("")
    (tmp_path / "bad.token").write_text("garbage")
    (tmp_path / "bad.token").chmod(0o600)
    kv = ["run", "kv.py", "-i", "x=1"]
    cases = [
        ([*kv, "--kv-disk", "16MiB:/dev/null"], 2, "--kv-disk: the disk tier cannot be made: "
                                                   "disk tier path /dev/null is not a directory"),
        ([*kv, "--kv-disk", "16MiB:afile/sub"], 2, "--kv-disk: the disk tier cannot be made: "
                                                   "cannot create directory afile/sub"),
        ([*kv, "--kv-disk", "16MiB:/proc/1/kvx"], 2, "--kv-disk: the disk tier cannot be made"),
        ([*kv, "--kv-disk", "16MiB:/sys/kvx"], 2, "--kv-disk: the disk tier cannot be made"),
        ([*kv, "--kv-disk", "100TiB:big"], 2, "--kv-disk: the disk tier cannot be made"),
        ([*kv, "--kv-host", "99999999999999999999999GiB"], 2, "is more than a machine holds"),
        ([*kv, "--kv-host", "60000TiB"], 2, "--kv-host: the host tier cannot be made"),
        (["cluster", "join", "tcp://127.0.0.1:9", "--kv-disk", "16MiB:/dev/null"], 2,
         "--kv-disk: the disk tier cannot be made: disk tier path /dev/null is not a directory"),
        (["cluster", "join", "tcp://127.0.0.1:9", "--kv-disk", "100TiB:big"], 2,
         "--kv-disk: the disk tier cannot be made"),
        (["run", "starts.py", "-i", "x=1"], 1,
         "node 'Model' failed to start: FileNotFoundError: no weights for Model"),
        (["cluster", "status", "tcp://127.0.0.1:9", "--token-file", "bad.token"], 2,
         "token file bad.token is not a valid Omni token file"),
        (["cluster", "status", "tcp://127.0.0.1:9", "--token-file", "none.token"], 2,
         "no token file at none.token"),
    ]
    for args, status, fragment in cases:
        done = omni_cli(*args, cwd=tmp_path)
        one_error_line(done, status, fragment)
        assert "metrics" not in done.stderr and done.stderr.count(".token") <= 1, args
        assert not (tmp_path / "ran").exists(), args
    record("cli.one_line", tries=len(cases),
           outcome=f"{len(cases)}/{len(cases)} one `error:` line naming the flag, node or file "
                   "and the cause, no traceback, nothing run: --kv-disk at /dev/null, under a "
                   "file, in /proc and /sys, of 100 TiB; --kv-host of 10^23 GiB and 60000 TiB; "
                   "--kv-disk at `omni cluster join`, before it joins (exit 2); a class node's "
                   "__aenter__ raising, omni.context() usable there (exit 1); a garbage or "
                   "missing token file (exit 2)")


def test_inputs_that_do_not_fit_the_annotations_are_refused_before_anything_runs(tmp_path,
                                                                                 record):
    (tmp_path / "typed.py").write_text(TYPED)
    run = ["run", "typed.py"]
    turn = ["-i", 'turn={"text": "hi"}']
    cases = [
        ([*run, "-i", 'turn="hi"'], "input 'turn': expected `object`, got `str`"),
        ([*run, "-i", 'turn={"txt": "hi"}'], "input 'turn': object missing required field"),
        ([*run, "-i", 'turn={"text": 3}'], "input 'turn.text': expected `str`, got `int`"),
        ([*run, "-i", 'turn={"text": "hi", "repeat": 0}'],
         "input 'turn.repeat': expected `int` >= 1"),
        ([*run, *turn, "-i", "voice=c"], "input 'voice': invalid enum value 'c'"),
        ([*run, *turn, "-i", "speed=fast"], "input 'speed': expected `float`, got `str`"),
        ([*run, *turn, "-i", "speed=true"], "input 'speed': expected `float`, got `bool`"),
    ]
    (tmp_path / "late.jsonl").write_text('{"turn": {"text": "a"}}\n' * 3
                                         + '{"turn": {"text": "b"}, "speed": [1]}\n')
    cases.append(([*run, "--inputs-json", "late.jsonl"],
                  "late.jsonl:4: graph 'typed': input 'speed': expected `float`, got `array`"))
    for args, fragment in cases:
        one_error_line(omni_cli(*args, cwd=tmp_path), 2, fragment)
        assert not (tmp_path / "ran").exists(), args
    done = omni_cli(*run, *turn, "-i", "speed=2", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, "hi\n"), done.stderr
    record("input.annotations", tries=len(cases) + 1,
           outcome=f"{len(cases)}/{len(cases)} refused with exit 2 before any node ran, the "
                   "line naming the input and where inside it (`turn.repeat`, `late.jsonl:4`): "
                   "a string for a dataclass, a missing or mistyped field, a constraint, a "
                   "Literal, text or a bool for a float; a fitting one ran")


def test_the_files_the_readme_commands_name_exist(record):
    """Every ``examples/...`` path and every ``--inputs-json`` file in the README's commands
    is in the repository, so a reader who copies a command finds what it reads."""
    text = (ROOT / "README.md").read_text()
    blocks = "\n".join(re.findall(r"```(?:sh|bash|console|)\n(.*?)```", text, flags=re.S))
    named = set(re.findall(r"(?<![\w/])(examples/[\w./-]+\.\w+)", blocks))
    named |= {p for p in re.findall(r"--inputs-json\s+(\S+)", blocks) if p != "-"}
    assert named, "the README's commands name no file"
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"the README's commands name files that do not exist: {missing}"
    record("docs.readme_files", tries=len(named),
           outcome=f"{len(named)}/{len(named)} files named by the README's commands exist")
