"""The API server's log redaction (`api.access_log`): an access-log line for a URL that carries a
key, a signing secret or a credential-named parameter keeps its shape and loses the secret."""

from __future__ import annotations

import io
import logging

from uvicorn.logging import AccessFormatter

from api.access_log import RedactSecrets, log_config

KEY = "kiln_abcdefghijkl" + "Q" * 40


def test_an_access_log_line_keeps_the_request_and_loses_its_secrets() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(AccessFormatter('%(client_addr)s - "%(request_line)s" %(status_code)s',
                                         use_colors=False))
    handler.addFilter(RedactSecrets())
    logger = logging.Logger("test.access")
    logger.addHandler(handler)
    # As uvicorn's h11 and httptools protocols log each request.
    for path in (f"/v1/events?after=7&key={KEY}", f"/v1/jobs/{KEY}",
                 "/hook?token=t0ps3cret&signature=v1,abc&whsec=whsec_c2VjcmV0",
                 "/v1/jobs?status=running&limit=5"):
        logger.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5000", "GET", path, "1.1", 400)
    assert out.getvalue().splitlines() == [
        '127.0.0.1:5000 - "GET /v1/events?after=7&key=[redacted] HTTP/1.1" 400 Bad Request',
        '127.0.0.1:5000 - "GET /v1/jobs/kiln_abcdefghijkl[redacted] HTTP/1.1" 400 Bad Request',
        '127.0.0.1:5000 - "GET /hook?token=[redacted]&signature=[redacted]'
        '&whsec=whsec_[redacted] HTTP/1.1" 400 Bad Request',
        '127.0.0.1:5000 - "GET /v1/jobs?status=running&limit=5 HTTP/1.1" 400 Bad Request']


def test_every_handler_of_the_servers_logging_redacts() -> None:
    config = log_config()
    assert config["handlers"] and all(h["filters"] == ["redact_secrets"]
                                      for h in config["handlers"].values())
    assert config["filters"]["redact_secrets"]["()"] is RedactSecrets
