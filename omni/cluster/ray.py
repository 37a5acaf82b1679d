"""``--cluster ray``: Omni's workers as Ray actors, on a Ray cluster the user already runs.

Ray does what it is built for: it starts one `OmniWorker` actor per Ray node (its processes
show as ``ray::OmniWorker``), pinned to that node, restarts it when its process dies, and a node
that joins the Ray cluster (by hand or by Ray's autoscaler) gets one within a second. Omni does
what Ray does not: the actor runs Omni's own worker loop (`omni.cluster.Worker`), which serves
Omni's RPC and data plane on the node's address (ZeroMQ with CURVE, shared memory on one host),
hosts class nodes' replicas and keeps their KV. Requests, stage values and KV pages never pass
through Ray's object store.

The driver (the process running the graph) hosts the cluster's `Head` itself: the actors
register with it and beat, so placement (``resources=``, ``where=``), replica repair, retries
and KV-aware routing are the same code as under ``omni cluster`` (`RayCluster` implements the
same `omni.cluster.membership.Membership`). A worker offers its Ray node's resources: ``CPU``,
``GPU`` and ``memory`` as Omni's ``cpu``, ``gpu`` and ``memory``, and the node's custom
resources under their own names, so ``resources={"node_b": 1}`` places a replica on the Ray node
started with ``--resources='{"node_b": 1}'``. The head spreads a node's replicas over the
workers, as Ray's SPREAD strategy would. The actors themselves ask Ray for nothing; each replica
holds what it asked for in Ray's accounting while it is hosted (a placement group of one bundle
on its worker's node), so Ray's own tasks beside Omni, and Ray's autoscaler, see it taken.

Secrets: the driver makes a fresh cluster token (CURVE keys) per run and hands it to each actor
in a method call once the actor is up (`OmniWorker.start`), never in the actor's constructor
arguments, which Ray keeps in its GCS to restart the actor; a restarted actor comes up without
it and the driver hands it over again. Between hosts the method call travels on Ray's own gRPC:
turn on Ray's TLS (``RAY_USE_TLS``) where that network is not trusted.

Lifetime: the actors are owned by the driver (not detached), so none outlives it; on a clean
exit the driver stops them first, so each leaves the head and unlinks its shared memory.
A worker killed outright (``kill -9``) is restarted by Ray; what it hosted is placed again by
the driver's repair task (as when a hand-joined worker dies), its KV is not assumed to survive,
and the shared-memory segments and sockets it left are reclaimed as a dead owner's.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import signal
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any

import trio

from omni.cluster._reclaim import reclaim_dead_owners
from omni.cluster.errors import ClusterError, NameTaken
from omni.cluster.head import Head
from omni.cluster.protocol import HEARTBEAT_S
from omni.cluster.worker import KVTiers, Worker
from omni.errors import describe
from omni.transport.credentials import Credentials
from omni.transport.security import ClusterToken

__all__ = ["OmniWorker", "RayCluster", "is_ray_address", "node_resources", "ray_resources"]

log = logging.getLogger("omni.cluster.ray")

SUPERVISE_S = 1.0  # seconds between looks at Ray's nodes and at the actors
START_TIMEOUT_S = 120.0  # an actor's start (its process, imports, registration) before giving up
PROBE_S = 5.0  # seconds to wait for a Ray address to accept a connection
RESERVE_S = 60.0  # seconds a replica waits for Ray to grant its resources on its node
MAX_RESTARTS = 10  # Ray restarts a dead OmniWorker this many times (a crash loop ends)
_RESOURCE_NAMES = {"CPU": "cpu", "GPU": "gpu", "memory": "memory"}
_RAY_ONLY = ("node:", "accelerator_type:")  # Ray's own bookkeeping resources
_RAY_ONLY_NAMES = ("object_store_memory",)


def is_ray_address(cluster: str) -> bool:
    """Whether a ``--cluster`` value names a Ray cluster: ``ray`` or ``ray://HOST:PORT``."""
    return cluster == "ray" or cluster.startswith("ray://")


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ClusterError("--cluster ray needs Ray installed here and on every Ray node: "
                           "pip install 'omni[ray]'") from None
    return ray


def ray_resources(resources: dict[str, float]) -> dict[str, float]:
    """Omni's resource names back in Ray's (`node_resources` the other way); none of 0."""
    omni_names = {omni_name: name for name, omni_name in _RESOURCE_NAMES.items()}
    return {omni_names.get(name, name): amount for name, amount in resources.items() if amount}


def node_resources(ray_resources: dict[str, float], share: int = 1) -> dict[str, float]:
    """What a worker on a Ray node offers, in Omni's names (see the module docstring);
    `share`: the node's workers, which split it evenly."""
    out: dict[str, float] = {}
    for name, amount in ray_resources.items():
        if name.startswith(_RAY_ONLY) or name in _RAY_ONLY_NAMES:
            continue
        out[_RESOURCE_NAMES.get(name, name)] = amount / share
    return out


class _Quiet(logging.Filter):
    """Drops one message of a library's logger."""

    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


def _restore_sigterm() -> None:
    """Put this process's own SIGTERM handler back in place of the one Ray's core worker
    installs in C++ when it connects (it prints a stack trace and, under load, aborted the
    process at exit after Omni's clean stop). Python still lists its handler; installing it
    again restores it at the C level. Only the main thread may (elsewhere: left as it is)."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGTERM)
    if handler is not None:
        signal.signal(signal.SIGTERM, handler)


def _brief(exc: BaseException) -> str:
    """An error's last line: Ray's errors from an actor carry the actor's whole traceback."""
    lines = str(exc).strip().splitlines()
    return lines[-1] if lines else type(exc).__name__


def _check_answers(address: str) -> None:
    """Fail at once when nothing listens at a Ray address given as HOST:PORT (``ray.init``
    would wait minutes for it), naming it.

    Raises:
        ClusterError: nothing accepts a connection there within `PROBE_S` seconds.
    """
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # "auto": Ray finds the cluster this machine belongs to, or says there is none
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_S).close()
    except OSError as exc:
        raise ClusterError(f"no Ray cluster answers at {address} ({exc.strerror or exc}): "
                           "start one with `ray start --head`, or set RAY_ADDRESS") from None


class OmniWorker:
    """One Omni worker in a Ray actor: `omni.cluster.Worker`'s loop on a thread of its own (its
    own trio loop), serving on the node's address. Made by `RayCluster` as a Ray actor; its
    constructor's arguments hold no secret.

    Args:
        name: the worker's name among the cluster's members (stable across restarts).
        resources: what it offers (Omni's names; see `node_resources`).
        kv: the KV tiers it offers.
        heartbeat_interval: seconds between its heartbeats to the head.
    """

    def __init__(self, name: str, resources: dict[str, float], kv: KVTiers,
                 heartbeat_interval: float = HEARTBEAT_S):
        self.name = name
        self.resources = resources
        self.kv = kv
        self.heartbeat_interval = heartbeat_interval
        self.host = _ray().util.get_node_ip_address()
        # Imported here, before the worker serves: importing torch holds the GIL for seconds,
        # and done at a first deployment it would starve the worker's heartbeats (its peers
        # would take it for dead). `omni cluster join` imports it as it starts, too.
        import torch  # noqa: F401
        # A restarted actor: what its killed predecessor left in shared memory goes now.
        reclaim_dead_owners(f"worker '{name}' starting")
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._endpoint = ""
        self._error: BaseException | None = None
        self._stop: Any = None  # stops the running worker, from any thread

    def start(self, head: str, token: ClusterToken) -> str:
        """Join the cluster whose head is at `head` (the driver's `token` reaches it); the
        worker's RPC endpoint once the head has it as a member. Does nothing more when running.

        Raises:
            ClusterError: the head refused it or it did not start (the message says why).
        """
        if self._thread is None or not self._thread.is_alive():
            self._started.clear()
            self._error = None
            self._thread = threading.Thread(target=self._serve, args=(head, token),
                                            name=f"omni-worker-{self.name}", daemon=True)
            self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise ClusterError(f"worker '{self.name}' did not join {head} within "
                               f"{START_TIMEOUT_S:g} s")
        if self._error is not None:
            raise ClusterError(f"worker '{self.name}' could not join {head}: "
                               f"{': '.join(describe(self._error))}")
        return self._endpoint

    def state(self) -> tuple[bool, int]:
        """(running, pid): what the driver's supervisor asks every second."""
        running = self._thread is not None and self._thread.is_alive() and not self._error
        return running, os.getpid()

    def stop(self) -> None:
        """Leave the cluster cleanly: drop the replicas, unlink the worker's shared memory."""
        if self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._stop()
        if self._thread is not None:
            self._thread.join(10.0)

    @property
    def _group_prefix(self) -> str:
        """The names of this worker's placement groups (one per hosted replica) begin so."""
        return f"omni-{self.name}/"

    def _remove_stale_groups(self) -> None:
        """Remove the placement groups an earlier process of this actor left: Ray ties them to
        the driver's job, not to the actor, so a killed worker's would hold its replicas'
        resources until the driver ends."""
        ray = _ray()
        for group in ray.util.placement_group_table().values():
            if group.get("name", "").startswith(self._group_prefix) and \
                    group.get("state") != "REMOVED":
                with contextlib.suppress(Exception):  # gone meanwhile
                    ray.util.remove_placement_group(
                        ray.util.get_placement_group(group["name"]))
                    log.info("removed placement group %s of an earlier process",
                             group["name"])

    def _serve(self, head: str, token: ClusterToken) -> None:
        try:
            self._remove_stale_groups()
            trio.run(self._run, head, token)
        except BaseException as exc:  # reported to the driver by `start`
            self._error = exc
            log.error("worker '%s' stopped: %s", self.name, ": ".join(describe(exc)))
        finally:
            self._stop = None
            self._started.set()

    async def _run(self, head: str, token: ClusterToken) -> None:
        with Credentials(token) as creds:
            # A restarted actor may register before the head has found its old process
            # silent (a few heartbeats): the name is taken until then.
            deadline = trio.current_time() + START_TIMEOUT_S
            while True:
                worker = Worker(self.name, head, creds, host=self.host, resources=self.resources,
                                kv=self.kv, heartbeat_interval=self.heartbeat_interval,
                                reserve=self._reserve)
                try:
                    async with trio.open_nursery() as nursery:
                        self._endpoint = await nursery.start(worker.run)
                        self._stop = functools.partial(
                            trio.from_thread.run_sync, worker.stop,
                            trio_token=trio.lowlevel.current_trio_token())
                        self._started.set()
                    return
                except BaseExceptionGroup as group:
                    taken, other = group.split(NameTaken)
                    if taken is None or other is not None or trio.current_time() > deadline:
                        raise
                await trio.sleep(self.heartbeat_interval)


    @contextlib.asynccontextmanager
    async def _reserve(self, resources: dict[str, float]) -> AsyncIterator[None]:
        """Hold a replica's resources in Ray's accounting while it is hosted: a placement
        group of one bundle on this node (pinned by its ``node:IP`` resource), removed with
        the replica, or by Ray with this actor's process."""
        bundle = ray_resources(resources)
        if not bundle:
            yield
            return
        bundle[f"node:{self.host}"] = 0.001
        ray = _ray()
        name = f"{self._group_prefix}{secrets.token_hex(4)}"
        group = await trio.to_thread.run_sync(functools.partial(
            ray.util.placement_group, [bundle], strategy="STRICT_PACK", name=name))
        try:
            ready, _ = await trio.to_thread.run_sync(
                functools.partial(ray.wait, [group.ready()], timeout=RESERVE_S),
                abandon_on_cancel=True)
            if not ready:
                wants = ", ".join(f"{k}={v:g}" for k, v in ray_resources(resources).items())
                raise ClusterError(f"Ray did not grant {wants} on node {self.host} within "
                                   f"{RESERVE_S:g} s: other Ray work holds them")
            yield
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(ray.util.remove_placement_group, group)


class _Actor:
    """The driver's record of one `OmniWorker` actor."""

    def __init__(self, name: str, node_id: str, handle: Any):
        self.name = name
        self.node_id = node_id
        self.handle = handle
        self.pid = 0
        self.starting: Any = None  # the ObjectRef of a start in progress
        self.endpoint = ""  # where its worker serves, once started ("" while it is not)


class RayCluster:
    """A Ray cluster as Omni's cluster (a `omni.cluster.membership.Membership`; see the
    module docstring): ``omni.Runtime(cluster="ray")`` and ``--cluster ray`` make one.

    Args:
        address: ``"ray"`` (``$RAY_ADDRESS``, else the cluster this machine belongs to) or
            ``"ray://HOST:PORT"`` (Ray Client). When Ray is already initialised in this process,
            its connection is used as it is.
        workers_per_node: `OmniWorker` actors per Ray node (they split its resources).
        kv: the KV tiers each worker offers.
        heartbeat_interval: seconds between heartbeats of the head and the workers.
        max_restarts: how many times Ray restarts a dead `OmniWorker`.
    """

    def __init__(self, address: str = "ray", *, workers_per_node: int = 1,
                 kv: KVTiers | None = None, heartbeat_interval: float = HEARTBEAT_S,
                 max_restarts: int = MAX_RESTARTS):
        if not is_ray_address(address):
            raise ClusterError(f"not a Ray cluster address: {address!r} (expected 'ray' or "
                               "'ray://HOST:PORT')")
        if workers_per_node < 1:
            raise ValueError(f"workers_per_node must be >= 1, got {workers_per_node!r}")
        self.address = address
        self.workers_per_node = workers_per_node
        self.kv = kv or KVTiers()
        self.heartbeat_interval = heartbeat_interval
        self.max_restarts = max_restarts
        self.description = ("the Ray cluster" if address == "ray" else
                            f"the Ray cluster at {address}")
        self.actors: dict[str, _Actor] = {}  # by member name
        self._lock = threading.Lock()  # the supervisor's thread and stop's

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[tuple[str, Credentials]]:
        # Ray connects from a worker thread: from the main thread, `ray.init` would install
        # a SIGTERM handler of its own (exiting at once) over the runtime's clean stop.
        ray = _ray()
        initialised = await trio.to_thread.run_sync(self._init, ray,
                                                    abandon_on_cancel=True)
        _restore_sigterm()
        try:
            token = ClusterToken.generate()
            with Credentials(token) as creds:
                host = ray.util.get_node_ip_address()
                head = Head(creds, f"tcp://{host}:*", heartbeat_interval=self.heartbeat_interval)
                async with trio.open_nursery() as nursery:
                    endpoint = await nursery.start(head.run)
                    try:
                        await trio.to_thread.run_sync(
                            functools.partial(self._sync, ray, endpoint, token, wait=True))
                        if not self.actors:
                            raise ClusterError(f"{self.description} has no live node")
                        nursery.start_soon(self._supervise, ray, endpoint, token)
                        yield endpoint, creds
                    finally:
                        with trio.CancelScope(shield=True):
                            await trio.to_thread.run_sync(self._stop_all, ray)
                        nursery.cancel_scope.cancel()
        finally:
            if initialised:
                await trio.to_thread.run_sync(ray.shutdown)

    def _init(self, ray: Any) -> bool:
        """Connect to the Ray cluster unless this process already is; whether it connected."""
        if ray.is_initialized():
            return False
        address = self.address if self.address != "ray" else (
            os.environ.get("RAY_ADDRESS") or "auto")
        _check_answers(address)
        quiet = _Quiet("SIGTERM handler is not set")  # ours handles signals: see `connect`
        ray_log = logging.getLogger("ray._private.worker")
        ray_log.addFilter(quiet)
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False,
                     configure_logging=False)
        except ConnectionError as exc:
            raise ClusterError(f"no Ray cluster at {address}: {exc} (start one with `ray start "
                               "--head`, or set RAY_ADDRESS)") from None
        except Exception as exc:  # Ray's own words: a missing `ray[client]`, a version clash
            raise ClusterError(f"cannot connect to the Ray cluster at {address}: "
                               f"{_brief(exc)}") from None
        finally:
            ray_log.removeFilter(quiet)
        return True

    async def _supervise(self, ray: Any, head: str, token: ClusterToken) -> None:
        while True:
            await trio.sleep(SUPERVISE_S)
            try:
                await trio.to_thread.run_sync(self._sync, ray, head, token)
            except Exception as exc:  # Ray's errors vary; try again next time
                log.warning("looking after the OmniWorker actors failed: %s", _brief(exc))

    def _sync(self, ray: Any, head: str, token: ClusterToken, *, wait: bool = False) -> None:
        """One look (in a thread: Ray's calls block): an actor for every live node that has
        none, the token for every actor that runs no worker (new, or restarted by Ray).
        `wait`: until every actor has answered and every start has ended (else a start goes
        on in its actor and is looked at again next time)."""
        with self._lock:
            nodes = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
            for name, actor in list(self.actors.items()):
                if actor.node_id not in nodes:  # the node is gone, and its actor with it
                    log.warning("the Ray node of worker '%s' is gone", name)
                    del self.actors[name]
            for node_id, node in nodes.items():
                for i in range(self.workers_per_node):
                    name = f"ray-{node_id[:8]}" + (f"-{i}" if self.workers_per_node > 1 else "")
                    if name not in self.actors:
                        self.actors[name] = self._create(ray, name, node)
            timeout = START_TIMEOUT_S if wait else SUPERVISE_S
            asked = {a.handle.state.remote(): a for a in self.actors.values()
                     if a.starting is None}
            answered, _ = ray.wait(list(asked), num_returns=len(asked), timeout=timeout)
            for ref in answered:
                actor = asked[ref]
                try:
                    running, actor.pid = ray.get(ref)
                except Exception as exc:  # dead or restarting: next look
                    log.info("worker '%s' does not answer: %s", actor.name, _brief(exc))
                    continue
                if not running:
                    actor.endpoint = ""
                    actor.starting = actor.handle.start.remote(head, token)
            starting = {a.starting: a for a in self.actors.values() if a.starting is not None}
            ended, _ = ray.wait(list(starting), num_returns=len(starting),
                                timeout=timeout if wait else 0)
            for ref in ended:
                actor = starting[ref]
                actor.starting = None
                try:
                    actor.endpoint = ray.get(ref)
                except Exception as exc:  # reported; tried again next look
                    log.warning("worker '%s' did not start: %s", actor.name, _brief(exc))
                    continue
                log.info("worker '%s' (pid %d) serving at %s", actor.name, actor.pid,
                         actor.endpoint)

    def _create(self, ray: Any, name: str, node: dict[str, Any]) -> _Actor:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        resources = node_resources(node.get("Resources", {}), self.workers_per_node)
        actor_class = ray.remote(OmniWorker).options(
            num_cpus=0, max_restarts=self.max_restarts, max_concurrency=4,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
        handle = actor_class.remote(name, resources, self.kv, self.heartbeat_interval)
        log.info("starting worker '%s' on Ray node %s (%s)", name, node["NodeID"][:8],
                 node.get("NodeManagerAddress", "?"))
        return _Actor(name, node["NodeID"], handle)

    def _stop_all(self, ray: Any) -> None:
        """Stop every worker cleanly (bounded), then end the actors."""
        with self._lock:
            refs = [a.handle.stop.remote() for a in self.actors.values()]
            with contextlib.suppress(Exception):
                ray.wait(refs, num_returns=len(refs), timeout=15.0)
            for actor in self.actors.values():
                with contextlib.suppress(Exception):
                    ray.kill(actor.handle, no_restart=True)
            self.actors.clear()
