"""The cluster's KV: which worker holds which pages (`directory`, fed by the workers' page
`events`) and fetching pages from a peer worker (`peers`, which imports torch).

`request_holders` is light on purpose: the worker sets it around each node call."""

import contextvars

__all__ = ["request_holders"]

# The workers that served earlier nodes of the request the current task serves, latest first,
# as (name, TCP endpoint) (`omni.cluster.remote.CallHead.kv_from`): pages they computed for it
# may be too new for the directory, so a fetch asks them when the directory knows no source.
request_holders: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "omni_kv_request_holders", default=())
