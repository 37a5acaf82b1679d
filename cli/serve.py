"""``omni serve``: serve a file's graphs over HTTP until Ctrl-C or SIGTERM, then drain."""

from __future__ import annotations

import functools
import hashlib
import re
import sys
import tempfile
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import trio
import typer

from cli._errors import CliError, Stopped, first_of, reporting
from cli._kv import kv_config
from cli._load import graphs_to_serve, load_module
from cli._options import (
    REPLACE_TIMEOUT_S,
    ClusterOption,
    DataPlaneOption,
    DebugOption,
    KvDeviceOption,
    KvDiskOption,
    KvHostOption,
    MetricsPortOption,
    ReplaceTimeoutOption,
    TokenFileOption,
    use_data_plane,
)
from cli._signals import stopped_by_signals
from cli.run import FILE_HELP
from omni import Graph, NodeError, Runtime
from omni.serve import DRAIN_TIMEOUT_S, ChatPolicy, FilePolicy, GuardState, MediaPolicy
from omni.serve import serve as serve_app

__all__ = ["serve"]

MAX_BODY_MIB = 32
MIN_KEY_CHARS = 16  # a shorter key can be guessed
KEY_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a tenant's name in a key file
KEY_FILE_HELP = ("one key per line, 'KEY' or 'NAME:KEY' ('NAME KEY' too), each key at least "
                 f"{MIN_KEY_CHARS} printable ASCII characters without spaces, a NAME letters, "
                 "digits, '.', '_' or '-'; a line starting with # is a comment")


class JsonWhitespace(StrEnum):
    """``--json-whitespace``'s choices (`ChatPolicy.json_whitespace`)."""

    any = "any"
    compact = "compact"


MEDIA = MediaPolicy()  # the defaults of the media options


def serve(
    file: Annotated[str, typer.Argument(metavar="FILE", help=FILE_HELP, show_default=False)],
    graph_names: Annotated[list[str] | None, typer.Argument(
        metavar="[GRAPH]...", show_default=False,
        help="Graphs of FILE to serve (default: every graph FILE defines).")] = None,
    host: Annotated[str, typer.Option(
        "--host", help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(
        "--port", "-p", min=0, max=65535, help="Port to listen on (0: a free one).")] = 8000,
    api_key_file: Annotated[str | None, typer.Option(
        "--api-key-file", metavar="PATH", show_default=False,
        help="Require 'Authorization: Bearer KEY' on /v1/ routes: each key of the file is a "
             f"tenant whose caches and sessions are its own ({KEY_FILE_HELP}).")] = None,
    metrics_key_file: Annotated[str | None, typer.Option(
        "--metrics-key-file", metavar="PATH", show_default=False,
        help="The operator's keys, the only ones /metrics takes once the server has keys (a "
             "tenant's key gets 403: the KV page counts tell prompt lengths); the format of "
             "--api-key-file. Without any key file /metrics is open, as is every route.")
    ] = None,
    max_concurrency: Annotated[int | None, typer.Option(
        "--max-concurrency", metavar="N", min=1, show_default=False,
        help="Answer 429 to a request beyond N in flight (default: no limit).")] = None,
    max_body_mib: Annotated[int, typer.Option(
        "--max-body-mib", metavar="MIB", min=1,
        help="Answer 413 to a request body larger than this.")] = MAX_BODY_MIB,
    drain_timeout: Annotated[float, typer.Option(
        "--drain-timeout", metavar="SECONDS", min=0,
        help="On Ctrl-C or SIGTERM, how long requests in flight may take to finish before "
             "they are cut.")
    ] = DRAIN_TIMEOUT_S,
    allow_remote_media: Annotated[bool, typer.Option(
        "--allow-remote-media",
        help="Let /v1/chat/completions fetch http(s) image URLs (default: data URLs only).")
    ] = False,
    max_image_pixels: Annotated[int, typer.Option(
        "--max-image-pixels", metavar="N", min=1,
        help="Answer 400 to a message's image of more pixels than this (checked from its "
             "header, before decoding).")] = MEDIA.max_image_pixels,
    max_media_mib: Annotated[int, typer.Option(
        "--max-media-mib", metavar="MIB", min=1,
        help="Answer 400 to a message's image or audio clip larger than this.")
    ] = MEDIA.max_item_bytes >> 20,
    max_request_pixels: Annotated[int, typer.Option(
        "--max-request-pixels", metavar="N", min=1,
        help="Answer 400 to a chat request whose images hold more pixels than this in all "
             "(read from their headers, before any is decoded).")] = MEDIA.max_request_pixels,
    max_request_samples: Annotated[int, typer.Option(
        "--max-request-samples", metavar="N", min=1,
        help="Answer 400 to a chat request whose audio clips hold more samples than this in "
             "all (every channel's; read from their headers).")] = MEDIA.max_request_samples,
    max_inflight_pixels: Annotated[int, typer.Option(
        "--max-inflight-pixels", metavar="N", min=1,
        help="The decoded pixels the chat requests in flight may hold at once (each until "
             "it is answered); a request without room waits for it, then gets 429 (at least "
             "--max-request-pixels).")
    ] = MEDIA.max_inflight_pixels,
    max_inflight_samples: Annotated[int, typer.Option(
        "--max-inflight-samples", metavar="N", min=1,
        help="The decoded audio samples the chat requests in flight may hold at once, as "
             "--max-inflight-pixels (at least --max-request-samples).")
    ] = MEDIA.max_inflight_samples,
    system_prompt: Annotated[str | None, typer.Option(
        "--system-prompt", metavar="TEXT", show_default=False,
        help="The system message of a /v1/chat/completions conversation that has none "
             "(default: none; a checkpoint's chat template may add its own).")] = None,
    json_whitespace: Annotated[JsonWhitespace, typer.Option(
        "--json-whitespace", case_sensitive=False,
        help="Whitespace a response_format JSON reply may hold between its tokens: 'any' "
             "(SGLang's default) or 'compact' (none beyond one space after ',' and ':'; a "
             "small model then cannot write blanks until max_tokens).")
    ] = JsonWhitespace.any,
    allow_path: Annotated[list[str] | None, typer.Option(
        "--allow-path", metavar="DIR", show_default=False,
        help="Let clients name input files (a graph's omni.InputFile inputs) under DIR; "
             "repeatable. Default: none, such inputs are refused.")] = None,
    kv_device: KvDeviceOption = None,
    kv_host: KvHostOption = None,
    kv_disk: KvDiskOption = None,
    cluster: ClusterOption = None,
    token_file: TokenFileOption = None,
    data_plane: DataPlaneOption = None,
    replace_timeout: ReplaceTimeoutOption = REPLACE_TIMEOUT_S,
    metrics_port: MetricsPortOption = None,
    debug: DebugOption = False,
) -> None:
    """Serve the graphs of FILE over HTTP: POST /v1/graphs/NAME for each, /v1/models,
    /health, /metrics (also on --metrics-port when given) and the API's docs at /docs;
    POST /v1/chat/completions and /v1/images/generations for graphs marked with
    omni.serve.openai's decorators; the playground page at /.

    Prints one line with the URL once it listens. Ctrl-C or SIGTERM drains: new requests get
    503, requests in flight may finish for up to --drain-timeout seconds (those still running
    then are cut: a stream ends with an error event), and it exits 0 as soon as none is left,
    saying how many finished and how many were cut.

    Example: omni serve examples/hello.py --port 8000
    """
    with reporting(debug):
        use_data_plane(data_plane)
        module = load_module(file)
        graphs = graphs_to_serve(module, graph_names or [], file)
        api_keys = _read_keys(api_key_file)
        state = GuardState(api_keys=api_keys,
                           metrics_keys=_metrics_keys(metrics_key_file, api_keys),
                           max_concurrency=max_concurrency,
                           max_body_bytes=max_body_mib * 1024 * 1024)
        kv = kv_config(module, file, device=kv_device, host=kv_host, disk=kv_disk)
        runtime = {"kv": kv, "cluster": cluster, "token_file": token_file, "metrics": True,
                   "metrics_port": metrics_port, "replace_timeout": replace_timeout}
        # the requests' output files live in a folder of this server's, gone when it exits
        with tempfile.TemporaryDirectory(prefix="omni-serve-") as outputs:
            files = _file_policy(allow_path or [], outputs)
            app = {"files": files, "chat": ChatPolicy(system_prompt, json_whitespace.value),
                   "media": _media_policy(allow_remote_media, max_image_pixels,
                                          max_media_mib << 20, max_request_pixels,
                                          max_request_samples, max_inflight_pixels,
                                          max_inflight_samples)}
            try:
                trio.run(functools.partial(_serve, graphs, state, runtime, host, port,
                                           drain_timeout, app))
            except Stopped as exc:
                sys.stderr.write(f"omni serve: stopped ({exc.signal_name}); "
                                 f"{_drained(state, drain_timeout)}\n")


def _media_policy(*limits: Any) -> MediaPolicy:
    try:
        return MediaPolicy(*limits)
    except ValueError as exc:
        raise CliError(f"{exc} (--max-inflight-pixels >= --max-request-pixels, "
                       "--max-inflight-samples >= --max-request-samples)") from None


def _file_policy(allow_paths: list[str], outputs: str) -> FilePolicy:
    try:
        return FilePolicy.create(allow_paths, outputs)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _read_keys(path: str | None, option: str = "--api-key-file") -> dict[str, str]:
    """The keys of `option`'s file `path` (see `KEY_FILE_HELP`), each mapped to its name:
    the one given on its line, else ``key-`` and 12 hex digits of its digest (stable, and
    telling nothing of the key). A mistake is a one-line `CliError` naming the file and line,
    never the key."""
    if path is None:
        return {}
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"{option} {path}: cannot read it "
                       f"({getattr(exc, 'strerror', None) or exc})") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            name, key = _key_line(line)
        except ValueError as exc:
            raise CliError(f"{option} {path}:{number}: {exc}") from None
        if key in keys:
            raise CliError(f"{option} {path}:{number}: this key is listed twice")
        if name in keys.values():
            raise CliError(f"{option} {path}:{number}: the name {name!r} is taken")
        keys[key] = name
    if not keys:
        raise CliError(f"{option} {path}: no key in it")
    return keys


def _key_line(line: str) -> tuple[str, str]:
    """A key file's line as (name, key); ValueError saying what is wrong, never quoting it.
    Unambiguous: a key holds no space, so two words are NAME KEY; one word is NAME:KEY when
    it holds a ':' (the first one ends the name), else KEY."""
    words = line.split()
    if len(words) > 2:
        raise ValueError(f"expected 'KEY', 'NAME:KEY' or 'NAME KEY', got {len(words)} words")
    if len(words) == 2:
        name, key = words
    else:
        name, colon, key = words[0].partition(":")
        if not colon:
            name, key = "key-" + hashlib.sha256(words[0].encode()).hexdigest()[:12], words[0]
    if not KEY_NAME.fullmatch(name):
        raise ValueError("a name is 1 to 64 letters, digits, '.', '_' or '-'")
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(f"the key is shorter than {MIN_KEY_CHARS} characters (draw one: "
                         "openssl rand -hex 32; '#' starts a comment only at a line's start)")
    if not (key.isascii() and key.isprintable()):
        raise ValueError("a key is printable ASCII, as an Authorization header carries it")
    return name, key


def _metrics_keys(path: str | None, api_keys: dict[str, str]) -> frozenset[str]:
    """``--metrics-key-file``'s keys; a `CliError` for one that is a tenant's too."""
    keys = _read_keys(path, "--metrics-key-file")
    if set(keys) & set(api_keys):
        raise CliError(f"--metrics-key-file {path}: a key of it is a tenant's too (in "
                       "--api-key-file): the operator's keys must be their own")
    return frozenset(keys)


def _drained(state: GuardState, timeout: float) -> str:
    """How the requests in flight at the stop ended, as the drain counted them."""
    finished, cut = state.num_finished, state.num_cut
    if not cut:
        return (f"every request in flight finished ({finished}), none cut" if finished
                else "no request was in flight")
    return (f"{finished} request(s) in flight finished, {cut} cut at the drain timeout "
            f"({timeout:g} s)")


async def _serve(graphs: dict[str, Graph], state: GuardState, runtime: dict[str, Any],
                 host: str, port: int, drain_timeout: float, app: dict[str, Any]) -> None:
    """Serve until a signal; `runtime` holds `omni.Runtime`'s options, `app` `serve`'s
    (the media, file and chat policies)."""
    stop = trio.Event()
    names = ", ".join(graphs)

    def ready(url: str) -> None:
        sys.stderr.write(f"omni serve: {url}  graphs: {names}  (docs: {url}/docs)\n")
        sys.stderr.flush()

    try:
        async with stopped_by_signals(stop.set), Runtime(
                graphs=list(graphs.values()), **runtime) as rt:
            await serve_app(rt, graphs, stop, host=host, port=port, state=state,
                            drain_timeout=drain_timeout, on_ready=ready, **app)
    except (OSError, BaseExceptionGroup) as exc:
        error = first_of(exc, OSError)
        if error is None:
            raise
        raise CliError(f"cannot listen on {host}:{port}: {error.strerror or error}") from exc
    except NodeError as exc:
        raise CliError(f"node '{exc.node}' failed to start: {exc.cause}") from exc
