"""Who may use the server: the Host a request names, the web page it comes from, its API key.

A page in a browser can send requests to a server on the user's machine: a "simple" POST
(text/plain, no preflight) from any site, or, by DNS rebinding (a site's name re-pointed at
127.0.0.1), requests whose replies it can read. The Host check refuses the rebinding (a
name this server does not go by), the Origin check refuses other sites' pages, and requiring
application/json turns every cross-site POST into a preflight that is refused."""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from email.message import Message

from .request import RequestError

PREFLIGHT_HEADERS = {"Access-Control-Allow-Methods": "GET, POST",
                     "Access-Control-Allow-Headers": "Authorization, Content-Type",
                     "Access-Control-Max-Age": "600"}


@dataclass(frozen=True)
class Access:
    api_key: str | None = None  # every request must carry `Authorization: Bearer <key>`
    allowed_hosts: tuple[str, ...] = ()  # Host names besides loopback and addresses; "*": any
    cors_origins: tuple[str, ...] = ()  # pages of these origins may call; "*": any


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_name(host: str) -> str:
    """The name in a Host header, without its port: "[::1]:8000" -> "::1"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def check_host(headers: Message, access: Access, bound: str) -> None:
    """A request must name this server: an address (no DNS, so no rebinding), localhost, the
    name it was bound to, or one of `allowed_hosts`."""
    host = headers.get("Host")
    if not host:
        raise RequestError(400, "a Host header is required")
    name = host_name(host)
    if "*" in access.allowed_hosts or _is_address(name) or \
            name in ("localhost", bound.lower(), *access.allowed_hosts):
        return
    raise RequestError(403, f"this server does not answer to the name '{name}'; allow it "
                       "with --allowed-host", code="host_not_allowed")


def check_origin(headers: Message, access: Access) -> str | None:
    """A browser's request from another site's page is refused unless its origin is allowed;
    returns that origin when the reply must carry CORS headers."""
    origin = headers.get("Origin")
    if origin is None:
        return None  # not from a browser page (or a same-origin GET)
    if "*" in access.cors_origins or origin in access.cors_origins:
        return origin
    host = (headers.get("Host") or "").strip().lower()
    if origin.lower() in (f"http://{host}", f"https://{host}"):
        return None  # the server's own page
    raise RequestError(403, f"requests from pages of {origin} are refused; allow them with "
                       "--cors-origin", code="origin_not_allowed")


def check_key(headers: Message, access: Access) -> None:
    if access.api_key is None:
        return
    given = (headers.get("Authorization") or "").encode()
    # Compared in constant time: how long a refusal takes says nothing of the key.
    if not hmac.compare_digest(given, f"Bearer {access.api_key}".encode()):
        raise RequestError(401, "a valid API key is required (Authorization: Bearer <key>)",
                           code="invalid_api_key")


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback
