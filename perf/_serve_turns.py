"""`perf/serve.py`'s multi-turn chats: ``omni serve`` against ``transformers serve
--continuous-batching`` on the same instruct checkpoint.

The checkpoint: a random Llama (hidden 512, 8 layers, 8 query and 4 KV heads, MLP 1,536:
~25 M parameters) with a byte-level BPE tokenizer, a ChatML chat template and a greedy
generation_config.json, saved by transformers (`tests.compute.checkpoint_builders`). Omni
serves it with ``OMNI_MODEL=DIR omni serve examples/omni_dialogue.py`` (the chat graph: the
checkpoint's template, its KV store reusing earlier turns); transformers with ``transformers
serve --continuous-batching DIR`` (its ``serving`` extra: ``pip install -e '.[bench]'``).

A session is a `turns`-turn conversation streamed through `openai.AsyncOpenAI`: a system
message, then per turn a new user message and `reply_tokens` tokens of reply, the reply
appended to the messages of the next turn (so each prompt is the whole conversation so far).
`sessions` run at once. Per (server, sessions): time to first token (the request to its
first content delta; p50 over every turn of every round) and output tokens per second (the
completion tokens of every turn, from `usage`, over the wall time of the round; median over
rounds). Both servers run at once, idle while the other is measured, the rounds alternating
between them. Claim: Omni's output tokens/s >= `TARGET` x transformers' at the largest
session count.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from perf._common import Samples, claim

__all__ = ["TARGET", "measure_turns"]

TARGET = 1.3  # omni's output tokens/s over transformers serve's, at the most sessions
ROOT = Path(__file__).resolve().parent.parent
DIALOGUE = ROOT / "examples" / "omni_dialogue.py"
READY = "omni serve: http://"
START_CAP_S = 300.0
SIZES = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 2048}
QUICK_SIZES = {"hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 1024}
SYSTEM = "You are a helpful assistant."
QUESTIONS = ("Hello there, how are you today?", "Tell me about the quick brown fox.",
             "And what about the lazy dog?", "Why do foxes jump over dogs?",
             "Could you say that again, more briefly?", "Thank you. Any last words?")
NOT_INSTALLED = ("transformers serve needs its serving extra (uvicorn): pip install -e "
                 "'.[bench]' (make bench installs it)")


def has_transformers_serve() -> bool:
    """Whether ``transformers serve`` can start here (its serving extra is installed)."""
    return importlib.util.find_spec("uvicorn") is not None


def save_model(folder: Path, quick: bool) -> tuple[Path, int]:
    """The instruct checkpoint both servers load, and its number of parameters."""
    from tests.compute.checkpoint_builders import save_checkpoint

    path = save_checkpoint(folder / "model", "llama", seed=0,
                           **(QUICK_SIZES if quick else SIZES))
    return path, (path / "model.safetensors").stat().st_size // 4  # float32 weights


class Server:
    """One server process: its URL, the name requests give as `model`, its stderr log."""

    def __init__(self, kind: str, model: Path, folder: Path) -> None:
        self.kind = kind
        self.log = folder / f"turns-{kind}.stderr"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if kind == "omni":
            args = [sys.executable, "-m", "cli", "serve", str(DIALOGUE), "--port", "0"]
            env["OMNI_MODEL"] = str(model)
            self.model = "chat"  # the dialogue file's chat graph
        else:
            port = _free_port()
            args = [sys.executable, "-c", "from transformers.cli.transformers import main; "
                    "main()", "serve", "--continuous-batching", "--host", "127.0.0.1",
                    "--port", str(port), str(model)]
            self.url, self.model = f"http://127.0.0.1:{port}", str(model)
        with open(self.log, "wb") as err:
            self.process = subprocess.Popen(args, cwd=ROOT, stdin=subprocess.DEVNULL,
                                            stdout=err, stderr=err, env=env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_CAP_S
        while time.monotonic() < deadline and self.process.poll() is None:
            if self.kind == "omni":
                lines = [line for line in self.log.read_text(errors="replace").splitlines()
                         if READY in line]
                if lines:
                    self.url = lines[0].split()[2]
                    return
            else:
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.kind} server did not start:\n"
                           f"{self.log.read_text(errors='replace')[-3000:]}")

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def chat_sessions(server: Server, sessions: int, turns: int,
                        reply_tokens: int) -> dict[str, Any]:
    """`sessions` conversations of `turns` streamed turns at once: TTFTs (s), completion
    tokens, wall seconds, the replies (per session, in order) and the first errors."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=600)
    ttfts: list[float] = []
    replies: list[list[str]] = [[] for _ in range(sessions)]
    tokens, errors = 0, []

    async def session(i: int) -> None:
        nonlocal tokens
        messages = [{"role": "system", "content": SYSTEM}]
        for turn in range(turns):
            messages.append({"role": "user",
                             "content": f"{QUESTIONS[turn % len(QUESTIONS)]} ({i})"})
            started, first, text, usage = time.perf_counter(), None, [], None
            stream = await client.chat.completions.create(
                model=server.model, messages=messages, max_tokens=reply_tokens,
                stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter()
                    text.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage
            if first is not None:
                ttfts.append(first - started)
            tokens += usage.completion_tokens if usage is not None else 0
            replies[i].append("".join(text))
            messages.append({"role": "assistant", "content": replies[i][-1]})

    async def guarded(i: int) -> None:
        try:
            await session(i)
        except Exception as exc:  # counted, and the first few kept: a claim, not a crash
            errors.append(f"{type(exc).__name__}: {exc}"[:300])

    started = time.perf_counter()
    await asyncio.gather(*(guarded(i) for i in range(sessions)))
    elapsed = time.perf_counter() - started
    await client.close()
    return {"ttfts": ttfts, "tokens": tokens, "seconds": elapsed, "replies": replies,
            "errors": errors}


def measure_turns(sessions: tuple[int, ...], turns: int, reply_tokens: int, repeats: int,
                  quick: bool, folder: Path) -> dict[str, Any]:
    """Both servers, a warm-up session each, then `repeats` rounds alternating between them
    of every session count; the claim."""
    model, size = save_model(folder, quick)
    shape = (sessions, turns, reply_tokens, repeats, size)
    if not has_transformers_serve():
        omni = _rounds(["omni"], model, sessions, turns, reply_tokens, repeats, folder)
        return _claim(omni, None, shape, NOT_INSTALLED)
    both = _rounds(["omni", "transformers"], model, sessions, turns, reply_tokens, repeats,
                   folder)
    return _claim(both, "transformers", shape, None)


def _rounds(kinds: list[str], model: Path, sessions: tuple[int, ...], turns: int,
            reply_tokens: int, repeats: int, folder: Path) -> dict[str, Any]:
    servers: dict[str, Server] = {}
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {
        kind: {s: [] for s in sessions} for kind in kinds}
    try:
        for kind in kinds:
            servers[kind] = Server(kind, model, folder)
            asyncio.run(chat_sessions(servers[kind], 1, turns, reply_tokens))  # warm-up
        for r in range(repeats):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                for count in sessions:
                    runs[kind][count].append(asyncio.run(chat_sessions(
                        servers[kind], count, turns, reply_tokens)))
    finally:
        codes = {kind: server.stop() for kind, server in servers.items()}
    return {"runs": runs, "exit_codes": codes}


def _side(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = sorted(t for run in runs for t in run["ttfts"])
    return {"output_tokens_per_s": Samples(tuple(run["tokens"] / run["seconds"]
                                                 for run in runs)),
            "ttft_p50_ms": round(ttfts[len(ttfts) // 2] * 1e3, 1) if ttfts else None,
            "errors": sum(len(run["errors"]) for run in runs),
            "first_errors": [e for run in runs for e in run["errors"]][:3]}


def _claim(measured: dict[str, Any], baseline: str | None,
           shape: tuple[tuple[int, ...], int, int, int, int],
           error: str | None) -> dict[str, Any]:
    sessions, turns, reply_tokens, repeats, size = shape
    runs = measured["runs"]
    cases = []
    for count in sessions:
        ours = _side(runs["omni"][count])
        theirs = _side(runs[baseline][count]) if baseline else None
        case: dict[str, Any] = {
            "sessions": count,
            "output_tokens_per_s": {"omni": ours["output_tokens_per_s"].to_json(1),
                                    "transformers": theirs and theirs[
                                        "output_tokens_per_s"].to_json(1)},
            "ttft_p50_ms": {"omni": ours["ttft_p50_ms"],
                            "transformers": theirs and theirs["ttft_p50_ms"]},
            "errors": {"omni": ours["errors"], "transformers": theirs and theirs["errors"]},
            "first_errors": ours["first_errors"] + (theirs["first_errors"] if theirs else []),
        }
        if theirs:
            case["ratio"] = round(ours["output_tokens_per_s"].median
                                  / theirs["output_tokens_per_s"].median, 3)
            case["first_replies_equal"] = _first_replies_equal(
                runs["omni"][count][0]["replies"], runs[baseline][count][0]["replies"])
        cases.append(case)
    top = sessions[-1]
    ours = _side(runs["omni"][top])
    theirs = _side(runs[baseline][top]) if baseline else None
    errors = sum(c["errors"]["omni"] + (c["errors"]["transformers"] or 0) for c in cases)
    ratio = None if theirs is None else (ours["output_tokens_per_s"].median
                                         / theirs["output_tokens_per_s"].median)
    return claim(
        unit="output tokens per second", target=TARGET,
        measured=ours["output_tokens_per_s"],
        baseline=None if theirs is None else theirs["output_tokens_per_s"], ratio=ratio,
        passed=ratio is not None and ratio >= TARGET and errors == 0, error=error,
        sessions=top, turns=turns, reply_tokens=reply_tokens, parameters=size, cases=cases,
        errors=errors, exit_codes=measured["exit_codes"],
        note=(f"{top} sessions at once, each a {turns}-turn conversation (a system message, "
              f"then a user message and a {reply_tokens}-token reply per turn, each prompt "
              "the whole conversation so far) streamed through openai.AsyncOpenAI; output "
              "tokens/s = completion tokens (usage) / wall time of the round, median over "
              f"{repeats} rounds alternating between the servers; TTFT: request to first "
              "content delta, p50 over every turn. Omni: OMNI_MODEL=DIR omni serve "
              "examples/omni_dialogue.py; baseline: transformers serve "
              "--continuous-batching DIR; the same random Llama checkpoint of "
              f"{size / 1e6:.2g} M parameters (ChatML template, greedy), float32 on this "
              "machine's CPUs. first_replies_equal: the "
              "share of the first round's sessions whose first reply is the same text on "
              "both servers."))


def _first_replies_equal(ours: list[list[str]], theirs: list[list[str]]) -> float:
    """The share of sessions whose first reply is the same text on both servers. Only the
    first: transformers serve's stream never sends a reply's last bytes when they end inside
    a UTF-8 character (its non-streamed reply, and Omni's, end in U+FFFD there), so the
    conversations may part from the second turn on."""
    pairs = [(a[0], b[0]) for a, b in zip(ours, theirs, strict=True) if a and b]
    return round(sum(a == b for a, b in pairs) / len(pairs), 3) if pairs else 0.0
