"""A message's remote image fetched as a hostile client's URL must be (``--allow-remote-media``).

"Fetch this URL for me" lets a client reach whatever the server can reach: its own port, the
cloud's metadata address, a private network. So the host is resolved first and every address
it resolves to must be public (not loopback, private, link-local, multicast, reserved or
unspecified, IPv4 and IPv6 alike, an IPv4 address inside an IPv6 one too); the connection goes
to the address checked, never to a second resolution (a name that resolves to a public address
once and to 127.0.0.1 the next time gains nothing); redirects are followed by hand, each hop
checked the same way, at most `MAX_REDIRECTS`; the whole fetch has one deadline, not one per
read; and a failure says only that the URL cannot be fetched: no status code, no connection
error that would tell which ports are open.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable

import anyio
import httpx

__all__ = ["MAX_REDIRECTS", "CannotFetch", "TooLarge", "fetch_public", "is_public",
           "resolve_host"]

MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[list[str]]]


class CannotFetch(Exception):
    """The URL cannot be fetched (refused address, network failure, deadline, a status other
    than 200); its text is for the server's logs, never for the client."""


class TooLarge(Exception):
    """The resource is larger than the bytes the server takes per item."""


def is_public(address: Address) -> bool:
    """Whether `address` is one a client may make the server connect to: a global unicast
    address; an IPv4 address mapped into IPv6 (``::ffff:a.b.c.d``) or embedded by 6to4 is
    judged as that IPv4 address."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is not None:
            return is_public(embedded)
        if address.is_site_local:
            return False
    return address.is_global and not (
        address.is_private or address.is_loopback or address.is_link_local
        or address.is_multicast or address.is_reserved or address.is_unspecified)


async def resolve_host(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (a worker thread does the lookup)."""
    found = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in found]


async def fetch_public(url: str, limit: int, deadline: float, *,
                       resolve: Resolver = resolve_host,
                       transport: httpx.AsyncBaseTransport | None = None) -> bytes:
    """The body of `url` (http or https), fetched from public addresses only, by `deadline`
    (on the event loop's clock), following at most `MAX_REDIRECTS` redirects.

    Raises:
        CannotFetch: a refused address, a failure on the way, a status other than 200 or the
            deadline passed.
        TooLarge: more than `limit` bytes.
    """
    try:
        with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
            async with httpx.AsyncClient(transport=transport, follow_redirects=False,
                                         timeout=None, trust_env=False) as client:
                return await _follow(client, httpx.URL(url), limit, resolve)
    except TimeoutError:
        raise CannotFetch(f"{url}: not fetched by the deadline") from None
    except (httpx.HTTPError, httpx.InvalidURL, OSError, UnicodeError) as exc:
        raise CannotFetch(f"{url}: {exc!r}") from None


async def _follow(client: httpx.AsyncClient, url: httpx.URL, limit: int,
                  resolve: Resolver) -> bytes:
    for _ in range(MAX_REDIRECTS + 1):
        request = await _pinned_request(client, url, resolve)
        response = await client.send(request, stream=True)
        try:
            if response.status_code in _REDIRECTS and "location" in response.headers:
                url = url.join(response.headers["location"])
                continue
            if response.status_code != 200:
                raise CannotFetch(f"{url}: answered {response.status_code}")
            return await _body(response, limit)
        finally:
            await response.aclose()
    raise CannotFetch(f"more than {MAX_REDIRECTS} redirects")


async def _pinned_request(client: httpx.AsyncClient, url: httpx.URL,
                          resolve: Resolver) -> httpx.Request:
    """A GET of `url` sent to the first address its host resolves to, once every address it
    resolves to was found public; the Host header and TLS's server name stay the URL's."""
    if url.scheme not in ("http", "https") or not url.host:
        raise CannotFetch(f"{url}: not an http(s) URL")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        addresses = [ipaddress.ip_address(a.split("%", 1)[0])
                     for a in await resolve(url.host, port)]
    except (OSError, ValueError) as exc:
        raise CannotFetch(f"{url.host}: {exc!r}") from None
    if not addresses or not all(is_public(a) for a in addresses):
        raise CannotFetch(f"{url.host} resolves to {addresses}: not all public")
    return client.build_request("GET", url.copy_with(host=str(addresses[0])),
                                headers={"Host": url.netloc.decode("ascii")},
                                extensions={"sni_hostname": url.host})


async def _body(response: httpx.Response, limit: int) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise TooLarge
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > limit:
            raise TooLarge
    return bytes(body)
