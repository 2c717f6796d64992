"""Service commands of the ``kiln`` CLI: ``kiln db upgrade``, ``kiln keys ...`` (API keys and
users' webhook secrets), ``kiln api``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

import typer

from common.settings import Settings

db_app = typer.Typer(no_args_is_help=True, help="Database schema (Alembic migrations).")
keys_app = typer.Typer(no_args_is_help=True, help="API keys and webhook secrets.")
app = typer.Typer()
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
) -> None:
    """Create or update the schema to the latest (or given) revision."""
    # Here, not at the top: Alembic and SQLAlchemy load only for the commands that need them.
    import migrations

    settings = Settings()
    migrations.upgrade(settings.database_url, revision)
    typer.echo(f"database at revision {revision}")


@db_app.command("downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision, e.g. -1 or base.")],
) -> None:
    """Step the schema back (drops data in removed tables)."""
    # Here, not at the top: Alembic and SQLAlchemy load only for the commands that need them.
    import migrations

    migrations.downgrade(Settings().database_url, revision)
    typer.echo(f"database at revision {revision}")


def _session(settings: Settings):  # noqa: ANN202 - a context-managed Session
    # Here, not at the top: SQLAlchemy loads only for the commands that use the database.
    from storage.db import make_engine, make_session_factory

    return make_session_factory(make_engine(settings.database_url))()


@keys_app.command("create")
def keys_create(
    user: Annotated[str, typer.Option("--user", help="User name; created if new.")],
    admin: Annotated[bool, typer.Option("--admin", help="The user sees every job.")] = False,
) -> None:
    """Create an API key and print it. It is shown only this once."""
    # Here, not at the top: the database layer loads only for the commands that use it.
    from storage.users import create_api_key

    with _session(Settings()) as session:
        try:
            new = create_api_key(session, user, is_admin=admin)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--user") from exc
        role = "admin" if new.user.is_admin else "user"
        typer.echo(new.key)
        typer.echo(f"key {new.prefix} for {role} {new.user.name!r}; store it now, it is not "
                   "shown again", err=True)


@keys_app.command("list")
def keys_list() -> None:
    """List keys (prefixes only: the keys themselves are not stored)."""
    # Here, not at the top: the database layer loads only for the commands that use it.
    from storage.users import list_api_keys

    with _session(Settings()) as session:
        for key, user in list_api_keys(session):
            state = "revoked" if key.revoked_at else "active"
            role = "admin" if user.is_admin else "user"
            typer.echo(f"{key.prefix}  {user.name}  {role}  {state}  {key.created_at:%Y-%m-%d}")


@keys_app.command("revoke")
def keys_revoke(prefix: Annotated[str, typer.Argument(help="The key's prefix.")]) -> None:
    """Revoke a key by its prefix."""
    # Here, not at the top: the database layer loads only for the commands that use it.
    from storage.users import revoke_api_key

    with _session(Settings()) as session:
        if not revoke_api_key(session, prefix):
            raise typer.BadParameter("no active key with that prefix", param_hint="PREFIX")
    typer.echo(f"revoked {prefix}")


@keys_app.command("rotate")
def keys_rotate(prefix: Annotated[str, typer.Argument(help="The key's prefix.")]) -> None:
    """Replace a key: print a new key for the same user and revoke the old one. When the old
    one is `kiln up`'s admin key, the new one replaces it in <data dir>/admin.key."""
    # Here, not at the top: the database layer loads only for the commands that use it.
    from kiln.cli import admin_key
    from storage.users import key_prefix, rotate_api_key

    settings = Settings()
    with _session(settings) as session:
        new = rotate_api_key(session, prefix)
        if new is None:
            raise typer.BadParameter("no active key with that prefix", param_hint="PREFIX")
        user = new.user.name
    kept = admin_key.read(settings.data_dir)
    if kept is not None and key_prefix(kept) == prefix:
        key_file = admin_key.write(settings.data_dir, new.key)
        typer.echo(f"key {new.prefix} replaces {prefix} (revoked) in {key_file}", err=True)
        return
    typer.echo(new.key)
    typer.echo(f"key {new.prefix} for {user!r} replaces {prefix} (revoked); store it "
               "now, it is not shown again", err=True)


@keys_app.command("webhook-secret")
def keys_webhook_secret(
    user: Annotated[str, typer.Option("--user", help="User name.")],
    rotate: Annotated[bool, typer.Option(
        "--rotate", help="Make a new secret; the old one signs beside it for "
        "webhook_secret_overlap_hours.")] = False,
) -> None:
    """Print a user's webhook signing secret (whsec_...), made if they have none. Every delivery
    of the user's jobs and batches is signed with it; the user reads it at GET
    /v1/webhook-secret."""
    # Here, not at the top: the database layer loads only for the commands that use it.
    from storage import webhook_secrets
    from storage.users import user_named

    settings = Settings()
    with _session(settings) as session:
        found = user_named(session, user)
        if found is None:
            raise typer.BadParameter("no such user", param_hint="--user")
        if rotate:
            overlap = timedelta(hours=settings.webhook_secret_overlap_hours)
            secrets = webhook_secrets.rotate(session, found.id, overlap=overlap)
        else:
            secrets = webhook_secrets.ensure(session, found.id)
    typer.echo(secrets.secret)
    if secrets.previous_until is not None:
        typer.echo(f"the previous secret of {user!r} still signs until "
                   f"{secrets.previous_until:%Y-%m-%d %H:%M} UTC", err=True)


@app.command("api")
def api(
    host: Annotated[str | None, typer.Option(help="Bind address (default from settings).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default from settings).")] = None,
    workers: Annotated[int, typer.Option(help="Uvicorn worker processes.")] = 1,
) -> None:
    """Serve the HTTP API (jobs, OpenAI-compatible videos, workers, metrics)."""
    # Here, not at the top: the server stack loads only for `kiln api`.
    import uvicorn

    from api.access_log import log_config

    settings = Settings()
    if settings.redis_url is None:
        raise typer.BadParameter(
            "no Redis configured: set REDIS_URL (or use `kiln up`, which starts one)"
        )
    grace = settings.api_shutdown_grace_seconds
    uvicorn.run(
        "api.app:app_from_env", factory=True, host=host or settings.api_host,
        port=port or settings.api_port, workers=workers, proxy_headers=True,
        # uvicorn annotates an int; it hands the value to asyncio.timeout, which takes a float.
        timeout_graceful_shutdown=grace,  # type: ignore[arg-type]  # a float works
        log_config=log_config(settings.log_level, settings.log_format),
    )
