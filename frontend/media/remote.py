"""The http(s) fetch of a media URL, guarded against server-side request forgery: a server that
fetches URLs its users name can be pointed at its own network (cloud metadata at 169.254.169.254,
admin ports on loopback), so fetching is off unless `--allowed-media-domains` names hosts.

Rules, each a 400 naming the request part: the URL's host must be named exactly; every address
the name resolves to must be public unless that address is named too; the connection goes to an
address so checked (the URL is pinned to it, with the name kept for Host and TLS, so a second DNS
answer cannot swap in another); redirects are followed by hand, at most MAX_REDIRECTS, each hop
checked again and never to another host; the body is streamed against the byte cap; the whole
fetch has one timeout; environment proxies are ignored (a proxy would connect where we cannot see).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import ssl
from urllib.parse import urljoin

import httpx

from frontend.common.errors import bad_request
from frontend.media.policy import MediaPolicy

MAX_REDIRECTS = 3
_REDIRECT_STATUSES = (301, 302, 303, 307, 308)


async def fetch_url(url: str, policy: MediaPolicy, param: str) -> bytes:
    """The body of an http(s) URL on an allowed host; raises APIError (400 naming `param`)."""
    if not policy.allowed_media_domains:
        raise bad_request(
            "http(s) media URLs are not allowed: the server was not started with "
            "--allowed-media-domains",
            param,
        )
    try:
        return await asyncio.wait_for(_fetch(url, policy, param), policy.fetch_timeout_s)
    except asyncio.TimeoutError:
        raise bad_request(
            f"fetching the media URL took longer than {policy.fetch_timeout_s:g} s", param
        ) from None


def is_public_address(address: str) -> bool:
    """Whether an IP address is on the public internet (not private, loopback, link-local,
    multicast, reserved or unspecified); IPv4 inside IPv6 (mapped, 6to4) is judged as IPv4."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is not None and not is_public_address(str(embedded)):
            return False
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
    return ip.is_global and not (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


async def _fetch(url: str, policy: MediaPolicy, param: str) -> bytes:
    first_host: str | None = None
    timeout = httpx.Timeout(policy.fetch_timeout_s)
    async with httpx.AsyncClient(
        verify=_ssl_context(), trust_env=False, follow_redirects=False, timeout=timeout
    ) as client:
        for _ in range(MAX_REDIRECTS + 1):
            target = _checked_url(url, policy, param)
            if first_host is None:
                first_host = _host(target)
            elif _host(target) != first_host:
                raise bad_request(
                    "the media URL redirects to another host, which is refused", param
                )
            addresses = await _vetted_addresses(target, policy, param)
            data, location = await _get(client, target, addresses, policy, param)
            if location is None:
                return data
            url = urljoin(str(target), location)
    raise bad_request(f"the media URL redirects more than {MAX_REDIRECTS} times", param)


def _checked_url(url: str, policy: MediaPolicy, param: str) -> httpx.URL:
    try:
        target = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError):
        raise bad_request("the media URL is not a valid URL", param) from None
    if target.scheme not in ("http", "https"):
        raise bad_request("the media URL redirects to a URL that is not http(s)", param)
    if target.userinfo:
        raise bad_request("media URLs must not carry credentials (user:password@)", param)
    host = _host(target)
    if host not in policy.allowed_media_domains:
        raise bad_request(f"the host {host!r} is not in --allowed-media-domains", param)
    return target


async def _vetted_addresses(target: httpx.URL, policy: MediaPolicy, param: str) -> list[str]:
    """The addresses to connect to: an IP-literal host as named, else every address the name
    resolves to, each public or itself named in the allowed list."""
    host = _host(target)
    try:
        ipaddress.ip_address(host)
        return [host]  # named in the allowed list, or _checked_url would have refused it
    except ValueError:
        pass
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise bad_request(f"the host {host!r} could not be resolved", param) from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for address in addresses:
        if not is_public_address(address) and address not in policy.allowed_media_domains:
            raise bad_request(
                f"the host {host!r} resolves to a non-public (private, loopback, link-local, "
                "multicast or reserved) address; --allowed-media-domains must name that address "
                "too to allow it",
                param,
            )
    return addresses


async def _get(
    client: httpx.AsyncClient,
    target: httpx.URL,
    addresses: list[str],
    policy: MediaPolicy,
    param: str,
) -> tuple[bytes, str | None]:
    """(body, None), or (b"", location) for a redirect; tries the addresses in turn."""
    for i, address in enumerate(addresses):
        headers, extensions = {}, {}
        pinned = target
        if address != _host(target):
            pinned = target.copy_with(host=address)
            headers["Host"] = target.netloc.decode("ascii")
            extensions["sni_hostname"] = target.host  # TLS checks the certificate by name
        try:
            async with client.stream(
                "GET", pinned, headers=headers, extensions=extensions
            ) as response:
                return await _read(response, policy, param)
        except httpx.ConnectError:
            if i + 1 == len(addresses):
                raise bad_request("could not connect to the media URL's host", param) from None
        except httpx.HTTPError as e:
            raise bad_request(
                f"fetching the media URL failed ({type(e).__name__})", param
            ) from None
    raise AssertionError("no addresses")  # _vetted_addresses returns at least one


async def _read(
    response: httpx.Response, policy: MediaPolicy, param: str
) -> tuple[bytes, str | None]:
    if response.status_code in _REDIRECT_STATUSES:
        location = response.headers.get("location")
        if not location:
            raise bad_request("the media URL redirects without a Location", param)
        return b"", location
    if not response.is_success:
        raise bad_request(f"fetching the media URL answered HTTP {response.status_code}", param)
    too_large = bad_request(
        f"the media URL's body is larger than {policy.max_image_bytes} bytes", param
    )
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > policy.max_image_bytes:
        raise too_large
    body = bytearray()
    async for chunk in response.aiter_bytes():  # decoded: a gzip bomb meets the cap too
        body += chunk
        if len(body) > policy.max_image_bytes:
            raise too_large
    return bytes(body), None


def _host(target: httpx.URL) -> str:
    """The URL's host as the allowed list spells it: lower case, no trailing dot, no brackets."""
    return target.host.rstrip(".").lower()


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One verifying TLS context for every fetch (building one loads the CA bundle)."""
    return httpx.create_ssl_context()
