"""Tenants and cache salts: no client learns what another one asked.

A shared prefix cache answers "was this prompt seen?" to anyone who can read
``cached_tokens`` or time a reply. So each API key is a tenant (the key file may name them),
and the cache salt a request runs under is derived from its tenant and the request's own
``cache_salt`` (vLLM's field): requests share pages only when both are the same. A request
of one tenant still reuses that tenant's earlier turns. A server without keys has one tenant:
every client shares its cache (and may learn what others asked), as on a single user's
machine.

State a graph keeps per tenant (the dialogue's sessions, each tenant with its own quota) is
keyed by `tenant_salt`, the tenant's alone: a client varies its ``cache_salt`` freely, but not
its tenant, and the server's tenants are the keys it was given.
"""

from __future__ import annotations

import hashlib
from typing import Any

from omni.graph.marks import cache_salt_mark
from omni.serve._errors import ApiError

__all__ = ["MAX_CACHE_SALT_CHARS", "TENANT_STATE", "cache_salt", "requested_salt",
           "tenant_of", "tenant_salt", "with_cache_salts"]

TENANT_STATE = "omni_tenant"  # the request's tenant, in the ASGI scope's "state" (the Guard)
MAX_CACHE_SALT_CHARS = 256


def tenant_of(request: Any) -> str:
    """The tenant the guard found for `request` ("" on a server without keys)."""
    return str(request.scope.get("state", {}).get(TENANT_STATE, ""))


def requested_salt(value: Any, param: str = "cache_salt") -> str:
    """A request's ``cache_salt`` field, checked (`ApiError` 400 for a non-string or one over
    `MAX_CACHE_SALT_CHARS`); "" when absent."""
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > MAX_CACHE_SALT_CHARS:
        raise ApiError(400, f"{param} must be a string of at most {MAX_CACHE_SALT_CHARS} "
                            "characters", param=param)
    return value


def cache_salt(tenant: str, requested: str) -> str:
    """The salt a request's cache keys get: "" for the keyless server's one tenant without a
    salt of its own (the unsalted cache, shared with ``omni run``), else a digest of both
    (never the tenant's name or the client's salt themselves)."""
    if not tenant and not requested:
        return ""
    return hashlib.blake2b(f"{tenant}\0{requested}".encode(), digest_size=16,
                           person=b"omni-cache-salt").hexdigest()


def tenant_salt(tenant: str) -> str:
    """The tenant's own salt, the same for each of its requests: "" for the keyless server's
    one tenant, else a digest of the tenant (never its name or key)."""
    if not tenant:
        return ""
    return hashlib.blake2b(tenant.encode(), digest_size=16,
                           person=b"omni-tenant").hexdigest()


def with_cache_salts(graph: Any, inputs: dict[str, Any], tenant: str,
                     requested: str) -> dict[str, Any]:
    """`inputs` with the graph's `omni.CacheSalt` inputs set to the request's salt (of
    `tenant` and its `requested` ``cache_salt``), or the tenant's alone for a
    ``CacheSalt(per="tenant")`` input: the server's to give, a client that sets one is
    refused (`ApiError` 400). Every route that runs a graph for a client passes its inputs
    through here."""
    salts = {"request": cache_salt(tenant, requested), "tenant": tenant_salt(tenant)}
    marked = {i.name: mark.per for i in graph.inputs
              if (mark := cache_salt_mark(i.type)) is not None}
    for name in marked:
        if name in inputs:
            raise ApiError(400, f"input '{name}' is the server's (the request's cache salt): "
                                'leave it out, and send "cache_salt" beside "inputs" to '
                                "scope the cache further", param=f"inputs.{name}")
    return {**inputs, **{name: salts[per] for name, per in marked.items()}}
