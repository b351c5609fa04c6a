"""Worker URLs in one canonical form, so that one server is one worker however its URL is
spelled (the flags, POST /workers and Kubernetes discovery all go through here).

    canonical_url("http://LOCALHOST:30000/")   -> "http://127.0.0.1:30000"
    canonical_url("http://2130706433:30000")   -> "http://127.0.0.1:30000"   (also 127.1, 0x7f.1, 0177.0.0.1)
    canonical_url("http://0.0.0.0:30000")      -> "http://127.0.0.1:30000"   (connecting to it reaches loopback)
    canonical_url("http://[::ffff:10.0.0.5]")  -> "http://10.0.0.5:80"
    canonical_url("http://Prefill.:30001")     -> "http://prefill:30001"

The form is scheme://host:port: the port always written (80 / 443 when absent), an IP
literal in its standard spelling (IPv6 compressed, in brackets), a DNS name lowercased
without its trailing dot (names are not resolved: a Kubernetes service name must stay a
name). Refused, with a UrlError saying why: URLs over MAX_URL_CHARS, userinfo (`user:pass@`
would be sent to the worker and shown wherever the URL is: logs, GET /workers, /metrics),
paths, queries, fragments, whitespace or non-ASCII characters, a host that ends in a number
but is not a valid IPv4 address (as browsers and the WHATWG URL standard refuse it), a
malformed DNS name, and port 0.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

MAX_URL_CHARS = 2048
MAX_HOST_CHARS = 253  # a DNS name's limit
_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")  # underscores: docker compose service names
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*")
DEFAULT_PORTS = {"http": 80, "https": 443}
UNSPECIFIED = {ipaddress.ip_address("0.0.0.0"): ipaddress.ip_address("127.0.0.1"),
               ipaddress.ip_address("::"): ipaddress.ip_address("::1")}


class UrlError(ValueError):
    """Why a worker URL is refused (the caller prefixes the flag or field)."""


def _shown(url: str) -> str:
    """The URL as an error message quotes it: never all of a huge one."""
    return repr(url) if len(url) <= 100 else repr(url[:80]) + f"... ({len(url)} characters)"


def _ipv4_number(part: str) -> int:
    """One part of a numeric IPv4 spelling, as inet_aton (and so the resolver behind
    httpx) reads it: 0x... hexadecimal, 0... octal, else decimal."""
    if part.startswith("0x"):
        return int(part[2:] or "0", 16)
    if len(part) > 1 and part.startswith("0"):
        return int(part, 8)
    return int(part, 10)


def parse_ipv4(host: str) -> ipaddress.IPv4Address:
    """127.0.0.1, 127.1, 2130706433, 0x7f000001, 0177.0.0.1...: 1 to 4 parts, the last one
    filling the bytes the others leave. ValueError if it is not a valid address."""
    parts = host.split(".")
    if not 1 <= len(parts) <= 4 or any(p == "" for p in parts):
        raise ValueError(host)
    numbers = [_ipv4_number(p) for p in parts]  # ValueError on a bad digit (e.g. 08)
    if any(n > 255 for n in numbers[:-1]) or numbers[-1] >= 256 ** (5 - len(numbers)):
        raise ValueError(host)
    value = numbers[-1]
    for i, n in enumerate(numbers[:-1]):
        value += n << (8 * (3 - i))
    return ipaddress.IPv4Address(value)


def canonical_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:10.0.0.5 is 10.0.0.5
    return UNSPECIFIED.get(ip, ip)


def canonical_host(host: str, bracketed: bool = False) -> str:
    """A host as the canonical URL writes it (IPv6 without brackets here). UrlError if invalid."""
    host = host.lower()
    if bracketed or ":" in host:
        try:
            ip = ipaddress.IPv6Address(host)
        except ValueError:
            raise UrlError(f"host {host!r} is not a valid IPv6 address") from None
        if ip.scope_id:
            raise UrlError(f"host {host!r}: IPv6 zone ids are not supported")
        return str(canonical_ip(ip))
    if host.endswith("."):
        host = host[:-1]  # "prefill." is "prefill"
    if host == "localhost":
        return "127.0.0.1"
    labels = host.split(".")
    if _NUMERIC_LABEL.fullmatch(labels[-1]):
        # Ends in a number: an IPv4 address in one of its spellings, or nothing valid.
        try:
            return str(canonical_ip(parse_ipv4(host)))
        except ValueError:
            raise UrlError(f"host {host!r} is not a valid IPv4 address") from None
    if not host or len(host) > MAX_HOST_CHARS or not all(_LABEL.fullmatch(label) for label in labels):
        raise UrlError(f"host {host[:80]!r} is not a valid host name (letters, digits, '-', '_' and dots; "
                       f"at most {MAX_HOST_CHARS} characters)")
    return host


def canonical_url(url: str) -> str:
    """The canonical form of a worker's base URL (see the module doc); UrlError if refused."""
    if len(url) > MAX_URL_CHARS:
        raise UrlError(f"{_shown(url)} is longer than {MAX_URL_CHARS} characters")
    if not url.isascii() or any(not c.isprintable() or c.isspace() for c in url):
        raise UrlError(f"{_shown(url)} has whitespace, control or non-ASCII characters")
    if "@" in url:  # checked first: no message below may quote the credentials
        raise UrlError(f"{_shown(url.split('@')[-1])}: credentials (a userinfo part before '@') are not allowed "
                       "in a worker URL")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a bad port, unbalanced brackets
        raise UrlError(f"{_shown(url)} is not a valid http(s)://host:port URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.netloc:
        raise UrlError(f"{_shown(url)} is not an http(s)://host:port URL")
    if parts.path not in ("", "/") or parts.query or parts.fragment or "?" in url or "#" in url:
        raise UrlError(f"{_shown(url)} must be a server's base URL (no path, query or fragment)")
    if port == 0:
        raise UrlError(f"{_shown(url)}: port must be in [1, 65535]")
    raw_host = parts.hostname  # lowercased, brackets stripped
    if not raw_host:
        raise UrlError(f"{_shown(url)} has no host")
    host = canonical_host(raw_host, bracketed=parts.netloc.startswith("["))
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port if port is not None else DEFAULT_PORTS[scheme]}"


def is_loopback_host(host: str) -> bool:
    try:
        return canonical_ip(ipaddress.ip_address(host.strip("[]"))).is_loopback
    except ValueError:
        return False


def is_own_address(url: str, host: str, port: int) -> bool:
    """Whether the canonical worker `url` is the address a router listening on `host`:`port`
    answers on (its --host, or any loopback address when it listens on all of them). What
    a literal comparison cannot see (another interface of this machine, a DNS name, a port
    forward) the router's health probe catches: its own /health carries its instance id."""
    parts = urlsplit(url)
    if parts.port != port:
        return False
    worker_host = parts.hostname or ""
    listen = host.strip("[]").lower()
    try:
        if ipaddress.ip_address(listen).is_unspecified:  # 0.0.0.0 / ::: every address, loopback included
            return is_loopback_host(worker_host) or worker_host == listen
    except ValueError:
        pass
    try:
        return canonical_host(listen) == worker_host.strip("[]")
    except UrlError:
        return False
