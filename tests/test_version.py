"""One version, pyproject.toml's: the API's OpenAPI document and ``kiln --version`` read it from
the installed package's metadata."""

from __future__ import annotations

import tomllib
from importlib.metadata import version
from pathlib import Path

from fastapi.testclient import TestClient
from typer.testing import CliRunner

from api.app import create_app
from common.settings import Settings
from kiln.cli import app as cli

ROOT = Path(__file__).resolve().parent.parent


def test_the_package_metadata_carries_pyproject_tomls_version() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version("kiln") == declared


def test_openapi_json_and_kiln_version_print_the_package_metadatas_version(
    tmp_path: Path,
) -> None:
    # Neither the database nor Redis is reached: both connect on first use, and the document
    # is served without the app's startup.
    settings = Settings(_env_file=None, database_url=f"sqlite:///{tmp_path / 'kiln.db'}",
                        redis_url="redis://127.0.0.1:1/0", output_dir=tmp_path / "outputs")
    document = TestClient(create_app(settings)).get("/openapi.json")
    assert document.status_code == 200
    assert document.json()["info"]["version"] == version("kiln")

    printed = CliRunner().invoke(cli, ["--version"])
    assert printed.exit_code == 0, printed.output
    assert printed.stdout == f"kiln {version('kiln')}\n"
