"""A webhook POST goes to the address that was checked: the host is resolved once, and a name
whose DNS answer changes after the check (rebinding) reaches no listener of the second answer;
https keeps the name's Host, SNI and certificate check; the receiver's answer is read only up to
a few KiB. DNS is the one thing faked here (``socket.getaddrinfo`` for one name); every listener
is a real socket."""

from __future__ import annotations

import datetime as dt
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from servers import Receiver
from task_helpers import make_settings, submit, succeed

from kiln import webhook_client
from kiln.tasks import Context, deliver
from storage import webhooks
from storage.tables import utcnow

NAME = "hooks.example.com"
PUBLIC = "93.184.216.34"


class Rebinding:
    """``NAME`` answers ``first`` to the first lookup and ``later`` to every one after it; other
    names (and IP literals) resolve as usual. ``lookups`` counts the lookups of ``NAME``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, first: str, later: str) -> None:
        self.lookups = 0
        real = socket.getaddrinfo

        def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
            if host != NAME:
                return real(host, port, *args, **kwargs)
            self.lookups += 1
            address = first if self.lookups == 1 else later
            return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "",
                     (address, int(port)))]

        # The socket module's own function: kiln's check and httpx's connection both use it.
        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_a_name_rebound_to_loopback_after_the_check_reaches_no_loopback_listener(
        ctx: Context, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx.settings = make_settings(ctx.settings.database_url, ctx.settings.redis_prefix, tmp_path,
                                 environment="production", webhook_allow_private=None,
                                 webhook_timeout_seconds=1)
    dns = Rebinding(monkeypatch, first=PUBLIC, later="127.0.0.1")
    t = utcnow() - timedelta(minutes=1)
    with Receiver() as loopback:
        port = int(loopback.url.split(":")[2].split("/")[0])
        with ctx.sessions() as s:
            job_id = submit(s, now=t, webhook_url=f"http://{NAME}:{port}/hook").id
            succeed(ctx, s, job_id, now=t)
        out = deliver(ctx, job_id, now=t)
        time.sleep(0.2)  # a POST, had one been sent to the loopback listener, would be there
        assert loopback.requests == []
    # One lookup, checked and used: the attempt went to the public address, which does not
    # answer here, so it is retried like any unreachable receiver.
    assert dns.lookups == 1
    assert (out.state, out.status) == ("pending", None)
    with ctx.sessions() as s:
        row = webhooks.delivery(s, job_id)
        assert row is not None and row.last_error is not None
        assert row.last_error.startswith(("ConnectError", "ConnectTimeout")), row.last_error


def test_the_post_goes_to_the_first_answer_with_the_names_host_header(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Private destinations allowed (the local environment): the address is still pinned.
    with Receiver(host="127.0.0.2") as receiver:
        port = receiver.httpd.server_address[1]
        dns = Rebinding(monkeypatch, first="127.0.0.2", later="127.0.0.3")
        posted = webhook_client.post(f"http://{NAME}:{port}/hook?x=1", body=b"{}",
                                     headers={"Content-Type": "application/json"},
                                     private_allowed=True, timeout_seconds=5)
    assert (posted.status, posted.error, posted.refused) == (200, None, None)
    assert dns.lookups == 1
    [got] = receiver.requests
    assert (got.path, got.headers["Host"], got.body) == ("/hook?x=1", f"{NAME}:{port}", b"{}")


def test_a_refused_answer_and_credentials_are_not_posted_to(
        monkeypatch: pytest.MonkeyPatch) -> None:
    Rebinding(monkeypatch, first="10.0.0.7", later=PUBLIC)
    posted = webhook_client.post(f"http://{NAME}/hook", body=b"{}", headers={},
                                 private_allowed=False, timeout_seconds=1)
    assert posted.refused == (f"{NAME} resolves to a refused address: "
                              "10.0.0.7 is a private address")
    with Receiver() as receiver:
        stored = receiver.url.replace("http://", "http://user:pw@")  # stored before the check
        posted = webhook_client.post(stored, body=b"{}", headers={}, private_allowed=True,
                                     timeout_seconds=1)
        assert posted.refused is not None and "user name or password" in posted.refused
        assert receiver.requests == []


def _certificates(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate for ``NAME`` it signed: (CA file, certificate file, key file)."""
    now = dt.datetime.now(dt.UTC)

    def cert(subject: str, key: Any, issuer: str, issuer_key: Any, ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - timedelta(hours=1))
                   .not_valid_after(now + timedelta(hours=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(subject)]),
                                            critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("kiln test CA", ca_key, "kiln test CA", ca_key, ca=True)
    leaf = cert(NAME, key, "kiln test CA", ca_key, ca=False)
    paths = tmp_path / "ca.pem", tmp_path / "leaf.pem", tmp_path / "leaf.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


@pytest.fixture
def trusted_ca(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path]]:
    ca, leaf, key = _certificates(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    webhook_client.tls_context.cache_clear()
    yield leaf, key
    webhook_client.tls_context.cache_clear()


def test_https_to_a_pinned_address_sends_the_names_sni_and_checks_its_certificate(
        trusted_ca: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    server_names: list[str | None] = []
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(*trusted_ca)
    tls.sni_callback = lambda _sock, name, _ctx: server_names.append(name)  # type: ignore[assignment,return-value]
    with Receiver(host="127.0.0.2") as receiver:
        receiver.httpd.socket = tls.wrap_socket(receiver.httpd.socket, server_side=True)
        port = receiver.httpd.server_address[1]
        dns = Rebinding(monkeypatch, first="127.0.0.2", later="127.0.0.3")
        posted = webhook_client.post(f"https://{NAME}:{port}/hook", body=b"{}", headers={},
                                     private_allowed=True, timeout_seconds=5)
        assert (posted.status, posted.error) == (200, None)
        assert server_names == [NAME] and dns.lookups == 1
        assert receiver.requests[0].headers["Host"] == f"{NAME}:{port}"
        # The same server under another name: its certificate does not match, nothing is sent.
        other = webhook_client.post(f"https://127.0.0.2:{port}/hook", body=b"{}", headers={},
                                    private_allowed=True, timeout_seconds=5)
        assert other.status is None and other.error is not None
        assert "CERTIFICATE_VERIFY_FAILED" in other.error or "match" in other.error
        assert len(receiver.requests) == 1


def test_only_the_first_kib_of_a_huge_answer_are_read() -> None:
    """A receiver that answers 200 with a 1 GiB body: the POST is a delivery, done in well under
    the time the body would take, and the receiver can write only what the socket buffers
    hold before kiln hangs up."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    written = 0

    def serve() -> None:
        nonlocal written
        conn, _ = listener.accept()
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\n\r\n")
            chunk = b"x" * 65536
            try:
                while written < 1 << 30:
                    conn.sendall(chunk)
                    written += len(chunk)
            except OSError:  # kiln closed the connection
                pass

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    started = time.monotonic()
    posted = webhook_client.post(f"http://127.0.0.1:{port}/hook", body=b"{}", headers={},
                                 private_allowed=True, timeout_seconds=10)
    took = time.monotonic() - started
    server.join(timeout=10)
    listener.close()
    assert (posted.status, posted.error) == (200, None)
    assert took < 2, took
    assert not server.is_alive() and written < 64 * 1024 * 1024, written
