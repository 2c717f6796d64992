"""The API server's log redaction (`api.access_log`): an access-log line for a URL that carries a
key, a signing secret or a credential-named parameter keeps its shape and loses the secret, under
the configuration `kiln api` hands uvicorn, which shows kiln's own INFO lines too."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from uvicorn.logging import AccessFormatter

from api.access_log import RedactSecrets, log_config

KEY = "kiln_abcdefghijkl" + "Q" * 40
ROOT = Path(__file__).resolve().parents[2]


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


def test_under_the_servers_logging_access_lines_are_redacted_and_kilns_info_lines_shown() -> None:
    # In a Python of its own: dictConfig closes every handler of the process it runs in.
    code = ("import logging, logging.config\n"
            "from api.access_log import log_config\n"
            "logging.config.dictConfig(log_config('INFO', 'json'))\n"
            "logging.getLogger('uvicorn.access').info("
            "'%s - \"%s %s HTTP/%s\" %d', '127.0.0.1:5000', 'GET', "
            f"'/v1/events?key={KEY}', '1.1', 400)\n"
            "from common import logs\n"
            "logging.getLogger('api.jobs').info('submitted by alice', "
            "extra=logs.fields(job='j1'))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_LOG_")}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    access, submitted = (json.loads(line) for line in done.stderr.splitlines())
    assert access["logger"] == "uvicorn.access" and access["process"] == "api"
    assert access["msg"] == '127.0.0.1:5000 - "GET /v1/events?key=[redacted] HTTP/1.1" 400'
    assert (submitted["logger"], submitted["level"], submitted["job"]) == ("api.jobs", "INFO", "j1")
