"""Which webhook destinations kiln may POST to.

A webhook URL is chosen by whoever submits a job, and the POST comes from inside the deployment,
so an unscreened URL would let a user make kiln call internal services (the cloud metadata
endpoint, an admin port on localhost, a database on the private network). Unless
``webhook_allow_private`` allows it, kiln posts only to http(s) URLs whose addresses are public:

* at submit time (`submit_refusal`): a host that is an IP literal in a refused range, or
  ``localhost``, is refused with a 422. Names are not resolved there: DNS may answer differently
  by delivery time anyway, and a submit must not wait on it. A URL with credentials in it
  (``http://user@host/``) is refused in every environment: they would go out as an
  ``Authorization`` header and sit in the job row, the dashboard and the logs.
* at delivery time (`resolve`): the host is resolved once and the POST is not sent when any of
  its addresses is refused; `kiln.webhook_client` then connects to one of those very addresses.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from common.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

SCHEMES = ("http", "https")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # well-known NAT64 prefix: an IPv4 in the low bits
_METADATA = ipaddress.ip_address("169.254.169.254")
# Deprecated IPv6 site-local (RFC 3879), still routed inside some networks; Python's is_global
# and is_private leave it out.
_SITE_LOCAL = ipaddress.ip_network("fec0::/10")


def private_allowed(s: Settings) -> bool:
    """Whether webhooks may go to loopback/private/link-local addresses: the setting, or when it
    is unset, only in the ``local`` environment (a receiver on the developer's own machine)."""
    if s.webhook_allow_private is not None:
        return s.webhook_allow_private
    return s.environment == "local"


def _embedded_ipv4(addr: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for (mapped ::ffff:a.b.c.d, 6to4, NAT64)."""
    if not isinstance(addr, ipaddress.IPv6Address):
        return None
    if addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    if addr.sixtofour is not None:
        return addr.sixtofour
    if addr in _NAT64:
        return ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    return None


def address_refusal(addr: IPAddress) -> str | None:
    """Why kiln must not POST to ``addr``, or None when it is a public unicast address."""
    embedded = _embedded_ipv4(addr)
    if embedded is not None:
        reason = address_refusal(embedded)
        return None if reason is None else f"{reason} (as {addr})"
    if addr == _METADATA:
        return f"{addr} is the cloud metadata address"
    if addr in _SITE_LOCAL:
        return f"{addr} is a site-local address"
    for refused, what in ((addr.is_unspecified, "an unspecified"), (addr.is_loopback, "a loopback"),
                          (addr.is_link_local, "a link-local"), (addr.is_multicast, "a multicast"),
                          (addr.is_private, "a private"), (addr.is_reserved, "a reserved")):
        if refused:
            return f"{addr} is {what} address"
    if not addr.is_global:  # shared (100.64.0.0/10) and other special-purpose ranges
        return f"{addr} is not a public address"
    return None


def _host(url: str) -> str:
    return (urlsplit(url).hostname or "").rstrip(".")


def _has_userinfo(parts: SplitResult) -> bool:
    return "@" in parts.netloc


def _form_refusal(url: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme.lower() not in SCHEMES:
        return "must be an http or https URL"
    if _has_userinfo(parts):
        return "must not carry a user name or password (user@host): they would be sent and stored"
    if not _host(url):
        return "must name a host"
    return None


def submit_refusal(url: str, *, private_allowed: bool) -> str | None:
    """Why ``url`` is refused as a webhook at submit time: credentials in it (always), or, when
    private destinations are not allowed, `literal_refusal`. None: accepted."""
    if _has_userinfo(urlsplit(url)):
        return _form_refusal(url)
    return None if private_allowed else literal_refusal(url)


def literal_refusal(url: str) -> str | None:
    """Why ``url`` is refused without resolving anything: not http(s), credentials in it, no
    host, ``localhost``, or an IP literal in a refused range. None: acceptable as far as can be
    told without DNS."""
    reason = _form_refusal(url)
    if reason is not None:
        return reason
    host = _host(url)
    if host == "localhost" or host.endswith(".localhost"):  # RFC 6761: always loopback
        reason = f"{host} is a loopback name"
    else:
        try:
            reason = address_refusal(ipaddress.ip_address(host))
        except ValueError:
            return None  # a name: resolved and checked when the webhook is sent
    return None if reason is None else f"{reason}; webhooks go to public addresses only"


@dataclass(frozen=True, slots=True)
class Resolved:
    """The addresses a webhook may be sent to, or why it may not be sent at all."""

    addresses: tuple[IPAddress, ...]  # in the resolver's order of preference; empty if refused
    refused: str | None  # why nothing may be posted; None: any of ``addresses`` will do


def resolve(url: str, *, private_allowed: bool) -> Resolved:
    """``url``'s host resolved once (an IP literal as itself) and, unless ``private_allowed``,
    every address checked: one refused address refuses them all. Raises `OSError`
    (`socket.gaierror`) when the host does not resolve.

    The caller connects to one of these addresses itself (`kiln.webhook_client`): resolving the
    name again for the connection would let a DNS answer that changed in between (rebinding,
    short TTLs) reach an address that was never checked."""
    reason = _form_refusal(url)
    if reason is not None:
        return Resolved(addresses=(), refused=reason)
    parts, host = urlsplit(url), _host(url)
    try:
        found: list[IPAddress] = [ipaddress.ip_address(host)]
        named = False
    except ValueError:  # a name
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        # A scoped IPv6 address comes as "fe80::1%eth0"; the scope does not change the range.
        found = list(dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
                                   for info in infos))
        named = True
    if not private_allowed:
        for addr in found:
            reason = address_refusal(addr)
            if reason is not None:
                return Resolved(addresses=(), refused=(
                    f"{host} resolves to a refused address: {reason}" if named else reason))
    return Resolved(addresses=tuple(found), refused=None)
