"""The HTTP side of one webhook attempt: the host is resolved once, every address it resolves to
is checked (`common.netguard.resolve`), and the POST is sent to a checked address itself, so a DNS
answer that changes between the check and the connection (rebinding) cannot send it elsewhere.

The request goes to ``scheme://<address>:<port>/path`` with the URL's own ``Host`` header and, for
https, the URL's host name as the TLS server name (httpcore's ``sni_hostname`` request extension),
against which the certificate is also verified. The receiver sees the same request as if it had
been sent to the name. Redirects are not followed, no proxy or ``.netrc`` from the environment is
used (either would connect somewhere else, or add credentials), and at most `MAX_ANSWER_BYTES` of
the answer's body are taken (the transport reads the socket 64 KiB at a time, so no more than
that is ever held).
"""

from __future__ import annotations

import os
import ssl
import time
from dataclasses import dataclass
from functools import lru_cache

import certifi
import httpx

from common import netguard

# The answer's status is all kiln uses; a small body is read whole so that the connection ends
# cleanly, a larger one is cut off here.
MAX_ANSWER_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Posted:
    status: int | None  # None: no answer
    error: str | None
    refused: str | None  # why the destination is refused (nothing was posted)


@lru_cache
def tls_context() -> ssl.SSLContext:
    """Verifies receivers' certificates: ``SSL_CERT_FILE`` when set (a deployment's own CA
    bundle), else certifi's. Read here because the client itself ignores the environment."""
    return ssl.create_default_context(cafile=os.environ.get("SSL_CERT_FILE") or certifi.where())


def post(url: str, *, body: bytes, headers: dict[str, str], private_allowed: bool,
         timeout_seconds: float) -> Posted:
    """POSTs ``body`` to ``url`` at an address that passed the destination check, trying the
    addresses in the resolver's order until one connects. Each connect, write and read waits at
    most ``timeout_seconds``; reading the answer's body stops after ``timeout_seconds`` in all."""
    try:
        resolved = netguard.resolve(url, private_allowed=private_allowed)
    except (OSError, ValueError) as exc:  # no such host, or DNS is down: retried
        return Posted(status=None, error=f"could not resolve the webhook host: {exc}"[:500],
                      refused=None)
    if resolved.refused is not None:
        return Posted(status=None, error=f"not sent: {resolved.refused}"[:500],
                      refused=resolved.refused)
    target = httpx.URL(url)
    # The URL's host and port as the receiver expects them in Host (userinfo was refused above).
    sent = {**headers, "Host": target.netloc.decode("ascii")}
    extensions = ({"sni_hostname": target.raw_host.decode("ascii")}
                  if target.scheme == "https" else {})
    error = "no address to connect to"
    with httpx.Client(timeout=timeout_seconds, follow_redirects=False, trust_env=False,
                      verify=tls_context()) as http:
        for address in resolved.addresses:
            request = http.build_request("POST", target.copy_with(host=str(address)),
                                         content=body, headers=sent, extensions=extensions)
            try:
                return _send(http, request, timeout_seconds)
            except httpx.ConnectError as exc:  # the next address may answer
                error = f"ConnectError: {exc}"
            except httpx.HTTPError as exc:
                return Posted(status=None, error=f"{type(exc).__name__}: {exc}"[:500],
                              refused=None)
    return Posted(status=None, error=error[:500], refused=None)


def _send(http: httpx.Client, request: httpx.Request, timeout_seconds: float) -> Posted:
    deadline = time.monotonic() + timeout_seconds
    response = http.send(request, stream=True)
    try:
        read = 0
        for chunk in response.iter_raw():
            read += len(chunk)
            if read >= MAX_ANSWER_BYTES or time.monotonic() > deadline:
                break
    finally:
        response.close()
    status = response.status_code
    error = None if 200 <= status < 300 else f"the receiver answered HTTP {status}"
    return Posted(status=status, error=error, refused=None)
