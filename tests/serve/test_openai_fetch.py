"""A remote image's fetch (`omni.serve.openai._fetch`): only public addresses, the address
checked is the one connected to, each redirect checked again, one deadline for the whole
fetch. The network is httpx's mock transport and a stand-in resolver."""

from __future__ import annotations

import ipaddress

import httpx
import pytest
import trio

from omni.serve.openai._fetch import (
    MAX_REDIRECTS,
    CannotFetch,
    TooLarge,
    fetch_public,
    is_public,
)

PUBLIC, OTHER = "93.184.216.34", "2606:4700::1111"


@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.255.0.9", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254",
    "100.64.0.1", "0.0.0.0", "255.255.255.255", "224.0.0.1", "240.0.0.1", "192.0.2.1",
    "::1", "::", "fe80::1", "fc00::1", "fd12::1", "ff02::1", "fec0::1", "::ffff:127.0.0.1",
    "::ffff:10.0.0.1", "::ffff:169.254.169.254", "2002:7f00:1::1", "2002:a00:1::1",
    "64:ff9b::7f00:1", "::7f00:1", "2001:db8::1"])
def test_loopback_private_link_local_multicast_reserved_addresses_are_not_public(
        address: str) -> None:
    assert not is_public(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", [PUBLIC, "8.8.8.8", OTHER, "::ffff:8.8.8.8",
                                     "2002:808:808::1"])
def test_global_addresses_are_public(address: str) -> None:
    assert is_public(ipaddress.ip_address(address))


def resolver(table: dict[str, list[str]]):
    async def resolve(host: str, port: int) -> list[str]:
        return table[host]
    return resolve


async def fetch(url: str, handler, table: dict[str, list[str]], limit: int = 1 << 20
                ) -> bytes:
    return await fetch_public(url, limit, trio.current_time() + 20,
                              resolve=resolver(table), transport=httpx.MockTransport(handler))


async def test_the_request_goes_to_the_address_checked_under_the_urls_name() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=b"pixels")

    assert await fetch("https://cats.example:8443/a.png?x=1", handler,
                       {"cats.example": [PUBLIC]}) == b"pixels"
    (request,) = seen
    assert str(request.url) == f"https://{PUBLIC}:8443/a.png?x=1"
    assert request.headers["host"] == "cats.example:8443"
    assert request.extensions["sni_hostname"] == "cats.example"  # TLS checks the name


@pytest.mark.parametrize("addresses", [["127.0.0.1"], [PUBLIC, "10.0.0.1"], ["::1"], []])
async def test_a_host_with_any_address_not_public_is_never_asked(addresses: list[str]) -> None:
    seen: list[httpx.Request] = []
    with pytest.raises(CannotFetch):
        await fetch("http://sneaky.example/a.png",
                    lambda r: seen.append(r) or httpx.Response(200),
                    {"sneaky.example": addresses})
    assert seen == []


async def test_each_redirect_is_checked_again_and_their_number_bounded() -> None:
    hops: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        hops.append(request.headers["host"])
        target = {"a.example": "http://b.example/next", "b.example": "/final",
                  "c.example": "http://inside.example/secret"}
        if request.headers["host"] in target and request.url.path != "/final":
            return httpx.Response(302, headers={"Location": target[request.headers["host"]]})
        return httpx.Response(200, content=b"at " + request.url.path.encode())

    table = {"a.example": [PUBLIC], "b.example": [OTHER], "c.example": [PUBLIC],
             "inside.example": ["192.168.0.7"], "loop.example": [PUBLIC]}
    assert await fetch("http://a.example/start", handler, table) == b"at /final"
    assert hops == ["a.example", "b.example", "b.example"]
    hops.clear()
    with pytest.raises(CannotFetch):
        await fetch("http://c.example/start", handler, table)
    assert hops == ["c.example"]  # the private hop was never asked

    def loop(request: httpx.Request) -> httpx.Response:
        hops.append(request.url.path)
        return httpx.Response(307, headers={"Location": "/again"})

    hops.clear()
    with pytest.raises(CannotFetch, match="redirects"):
        await fetch("http://loop.example/", loop, table)
    assert len(hops) == MAX_REDIRECTS + 1


async def test_a_status_other_than_200_and_a_body_over_the_limit_are_refused() -> None:
    table = {"x.example": [PUBLIC]}
    with pytest.raises(CannotFetch):
        await fetch("http://x.example/", lambda r: httpx.Response(404), table)
    with pytest.raises(TooLarge):
        await fetch("http://x.example/", lambda r: httpx.Response(200, content=b"x" * 101),
                    table, limit=100)


async def test_one_deadline_bounds_the_whole_fetch_however_slowly_it_trickles(
        autojump_clock) -> None:
    async def trickle():
        while True:  # a byte every 10 s: no read ever waits long
            yield b"x"
            await trio.sleep(10)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=trickle())

    start = trio.current_time()
    with pytest.raises(CannotFetch, match="deadline"):
        await fetch("http://slow.example/", handler, {"slow.example": [PUBLIC]})
    assert trio.current_time() - start == pytest.approx(20)
