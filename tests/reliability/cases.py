"""Every fault and hostile input the reliability suite tries, by key.

Why a registry: each test records its case by key (`record("disk.flipped_bits", ...)`), the
README's reliability table is rendered in this order, and a cheap test checks the README
against this list and the tests' source without running anything, so neither can drift.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["CASES", "ELSEWHERE", "Case"]


class Case(NamedTuple):
    area: str
    case: str


CASES: dict[str, Case] = {
    # Control flow: nodes that fail, hang or are cancelled
    "graph.node_raises": Case("Graph", "a node raising, among concurrent requests"),
    "graph.node_timeout": Case("Graph", "a node hanging past its timeout"),
    "graph.cancel_mid_stream": Case(
        "Graph", "a streaming node cancelled mid-stream while it holds KV leases"),
    "graph.stream_teed": Case(
        "Graph", "one stream read through two parameters of a node, and by another node"),
    # The KV store and its tiers
    "kv.all_pinned": Case("KV store", "memory pressure with every page pinned"),
    "disk.flipped_bits": Case("KV disk tier", "a page with flipped bits"),
    "disk.truncated": Case("KV disk tier", "the page file truncated"),
    "disk.full": Case("KV disk tier", "disk full: writes fail (ENOSPC) or come up short"),
    "disk.read_error": Case("KV disk tier", "reads fail with an I/O error (EIO)"),
    "disk.dir_deleted": Case("KV disk tier", "the KV directory deleted under a running store"),
    "disk.hang": Case("KV disk tier", "a disk write, then a disk read, that hangs under a "
                      "running store"),
    "shm.deleted": Case("KV host tier", "its shared-memory files deleted under a running store"),
    "shm.small": Case("KV host tier", "a /dev/shm of 64 MiB (a container's default) under a "
                      "host tier configured for 256 MiB"),
    "shm.small_run": Case("KV host tier", "`omni run` with the default KV tiers in a 64 MiB "
                          "/dev/shm"),
    # Processes dying
    "proc.lease_holder_killed": Case(
        "Processes", "a worker SIGKILLed while it holds shared-memory leases"),
    "proc.holder_killed_mid_transfer": Case(
        "Processes", "a worker SIGKILLed mid-transfer (serving `kv.fetch`)"),
    "proc.owner_killed": Case(
        "Processes", "KV store owners SIGKILLed: their arenas and lease tables left behind"),
    "proc.owner_lost_head": Case(
        "Processes", "a KV store owner that is a cluster member SIGKILLed: the head finds it "
        "lost, no store starts after it"),
    "proc.owner_lost_roster": Case(
        "Processes", "a KV store owner that is a cluster member SIGKILLed, the head on another "
        "host: a roster (driver or worker) on its host sees it leave, no store starts after it"),
    "proc.run_signalled": Case(
        "Processes", "Ctrl-C or SIGTERM in the middle of `omni run` with a KV store"),
    "proc.serve_drained": Case(
        "Processes", "SIGTERM to `omni serve` under traffic: requests finishing during the "
        "drain, streams outliving `--drain-timeout`, idle keep-alive connections"),
    "proc.worker_killed_mid_run": Case(
        "Processes", "the worker hosting a class node SIGKILLed in the middle of `omni run -c 4 "
        "--cluster`, another worker up"),
    "serve.worker_killed": Case(
        "Processes", "the worker hosting a served chat graph's node SIGKILLed with 8 replies "
        "in flight on it (`omni serve --cluster`): 6 collected whole, 2 streams before their "
        "first chunk"),
    "proc.no_worker_left": Case(
        "Processes", "the only worker SIGKILLed in the middle of `omni run --cluster "
        "--replace-timeout 2`: nowhere to place its replica again"),
    # Peers on the wire
    "peer.silent": Case("Wire", "a ZeroMQ peer that stops answering"),
    "peer.garbage": Case("Wire", "a ZeroMQ peer that replies garbage"),
    "peer.loaded": Case("Wire", "a peer answering late on a machine at full CPU load, then "
                        "one stopped (SIGSTOP) and resumed"),
    "peer.wrong_pages": Case(
        "Wire", "a peer's reply with other keys' pages, a bad checksum or a bad header"),
    # Hostile input
    "input.annotations": Case(
        "Hostile input", "inputs that do not fit the graph's annotations (`--input`, a JSON line)"),
    "input.wire_mutations": Case(
        "Hostile input", "wire decoder: mutated valid frames and KV fetch messages (fuzz)"),
    "input.descriptor_fuzz": Case("Hostile input", "descriptor opener: random fields (fuzz)"),
    "input.descriptor_other_arena": Case(
        "Hostile input", "a descriptor naming another arena or lease table"),
    "input.descriptor_out_of_bounds": Case(
        "Hostile input", "a descriptor with offsets out of bounds or misaligned"),
    "input.inputs_json": Case("Hostile input", "`--inputs-json` parsing (fuzz)"),
    "input.endless": Case(
        "Hostile input", "`--inputs-json` of an endless or binary file, or an oversize line"),
    "input.assignments": Case(
        "Hostile input", "graph-file inputs: `--input KEY=VALUE` and request building (fuzz)"),
    "input.key_traversal": Case(
        "Hostile input", "page keys and store ids that try path traversal on the disk tier"),
    "input.oversize": Case("Hostile input", "an oversize message"),
    "input.unauthenticated_join": Case("Hostile input", "an unauthenticated join"),
    "serve.client_paths": Case(
        "Hostile client", "`omni serve`: a client naming server paths to write (`out`) and to "
        "read (`image`, `audio`)"),
    "serve.bounded_work": Case(
        "Hostile client", "`omni serve`: a PNG of a few KB holding 12,000 x 12,000 pixels (a "
        "decompression bomb) and a 30 MB message, with /health polled meanwhile"),
    "serve.media_budget": Case(
        "Hostile client", "`omni serve`: twenty 4,096 x 4,096 PNGs of 2.8 KiB each (1 GB "
        "decoded) in one request, with /health polled meanwhile"),
    "serve.malformed_media": Case(
        "Hostile client", "`omni serve`: audio clips too short for the encoder, cut "
        "mid-sample or without a format, a lone surrogate in a text"),
    "serve.remote_media_ssrf": Case(
        "Hostile client", "`omni serve --allow-remote-media`: image URLs at the server's own "
        "machine, private and link-local addresses"),
    "serve.tenant_probe": Case(
        "Hostile client", "`omni serve`: a tenant guessing another's prompt from "
        "`cached_tokens`"),
    "serve.tenant_sessions": Case(
        "Hostile client", "`omni serve`: a tenant opening more dialogue sessions than its "
        "quota, to evict another tenant's conversation"),
    "serve.tenant_media": Case(
        "Hostile client", "`omni serve` of a Qwen3-Omni checkpoint: a tenant sending the image "
        "another just sent, asking for speech (a cache hit would answer faster)"),
    "serve.tenant_metrics": Case(
        "Hostile client", "`omni serve`: a tenant reading /metrics, whose KV page counts tell "
        "another tenant's prompt length"),
    # A user's mistakes at the command line
    "cli.one_line": Case(
        "Command line", "KV flags at files, devices, /proc, /sys, impossible sizes; a node "
        "failing as it starts; a bad or missing token file"),
    "cli.worker_start_error": Case(
        "Command line", "a class node failing as it starts on a cluster worker (`omni run "
        "--cluster`, then with `--debug`)"),
    "cli.worker_environment": Case(
        "Command line", "a worker started without the `OMNI_MODEL` the driver has: the graph "
        "file's KV layout differs there"),
    "docs.readme_files": Case("Command line", "the files the README's commands name"),
    # What the runtime leaves on the machine
    "files.private": Case("Files", "files and shared memory it creates are private to its user"),
    "files.removed": Case("Files", "files and shared memory it creates are removed on clean exit"),
}

# Faults with tests of their own elsewhere in the suite (not recorded here): listed under the
# table as "covered by", each as (what, pytest node id).
ELSEWHERE: tuple[tuple[str, str], ...] = (
    ("a worker SIGKILLed mid-request: calls fail over, the worker rejoins",
     "tests/cluster/test_cluster_faults.py::test_a_sigkilled_worker_fails_over_and_rejoins"),
    ("the cluster head restarting",
     "tests/cluster/test_cluster_faults.py::test_the_head_restarting_is_rejoined"),
    ("`omni cluster join` with the wrong token",
     "tests/cluster/test_cluster_cli.py::test_a_join_with_the_wrong_token_is_refused"),
    ("garbage frames sent to an RPC server",
     "tests/transport/test_rpc.py::test_garbage_frames_from_a_raw_dealer_are_counted_and_dropped"),
    ("a same-host peer breaking the Unix socket framing (too many frames, oversize, cut short)",
     "tests/transport/test_unix.py::test_a_peer_that_breaks_the_format_is_cut_off_and_others_are_served"),
    ("wire decoder fuzz: random bytes, truncated frames, wrong shapes",
     "tests/transport/test_wire.py::test_fuzz_random_bytes_raise_only_wire_error"),
    ("value decoder fuzz (tensors and arrays on the wire)",
     "tests/transport/test_values.py::test_fuzz_random_bytes_raise_only_wire_error"),
    ("CURVE clients with a wrong or missing key get nothing through",
     "tests/transport/test_security.py::test_a_wrong_client_key_is_refused_before_any_data"),
    ("a token file others can read is refused",
     "tests/transport/test_security.py::test_a_token_others_can_access_is_refused_with_the_fix"),
    ("many threads using one store",
     "tests/kv/test_threads.py::test_many_threads_put_acquire_and_release_without_corruption"),
)
