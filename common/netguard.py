"""Which webhook destinations kiln may POST to.

A webhook URL is chosen by whoever submits a job, and the POST comes from inside the deployment,
so an unscreened URL would let a user make kiln call internal services (the cloud metadata
endpoint, an admin port on localhost, a database on the private network). Unless
``webhook_allow_private`` allows it, kiln posts only to http(s) URLs whose addresses are public:

* at submit time (`literal_refusal`): a host that is an IP literal in a refused range, or
  ``localhost``, is refused with a 422. Names are not resolved there: DNS may answer differently
  by delivery time anyway, and a submit must not wait on it.
* at delivery time (`resolved_refusal`): the host is resolved and the POST is not sent when any
  of its addresses is refused.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from common.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

SCHEMES = ("http", "https")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # well-known NAT64 prefix: an IPv4 in the low bits
_METADATA = ipaddress.ip_address("169.254.169.254")


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


def _form_refusal(url: str) -> str | None:
    if urlsplit(url).scheme.lower() not in SCHEMES:
        return "must be an http or https URL"
    if not _host(url):
        return "must name a host"
    return None


def literal_refusal(url: str) -> str | None:
    """Why ``url`` is refused without resolving anything: not http(s), no host, ``localhost``, or
    an IP literal in a refused range. None: acceptable as far as can be told without DNS."""
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


def resolved_refusal(url: str) -> str | None:
    """Why kiln must not POST to ``url`` now: not http(s), or its host is a refused IP literal
    or a name that resolves to any refused address. Raises `OSError` (`socket.gaierror`) when the
    host does not resolve.

    The POST that follows resolves the name again (resolve, then connect), so a name whose DNS
    answer changes in between (DNS rebinding, short TTLs) can still reach a refused address;
    closing that window needs connecting to the checked address itself."""
    reason = _form_refusal(url)
    if reason is not None:
        return reason
    parts, host = urlsplit(url), _host(url)
    try:
        return address_refusal(ipaddress.ip_address(host))
    except ValueError:
        pass  # a name
    port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        reason = address_refusal(ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0]))
        if reason is not None:
            return f"{host} resolves to a refused address: {reason}"
    return None
