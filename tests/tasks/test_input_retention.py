"""Retention of uploaded input files: the periodic clean-up deletes those uploaded more than
retention_days ago, object and row, and keeps the others."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from task_helpers import make_settings, user

from kiln.tasks import Context, clean_up_inputs
from storage import input_files
from storage.media import Media
from storage.tables import InputFile, utcnow

PNG = Media("image", "image/png", "png", 64, 48, 1, None)


def _uploaded(ctx: Context, *, days_ago: float) -> InputFile:
    with ctx.sessions() as s:
        row = input_files.new_input_file(user(s), PNG, file_id=input_files.new_file_id(),
                                         purpose="image", filename="a.png", size_bytes=3)
        row.created_at = utcnow() - timedelta(days=days_ago)
        ctx.store.put_bytes(row.storage_key, b"png")
        s.add(row)
        s.commit()
        return row


def test_inputs_older_than_retention_go_object_and_row(ctx: Context) -> None:
    old, recent = _uploaded(ctx, days_ago=31), _uploaded(ctx, days_ago=29)
    gone_already = _uploaded(ctx, days_ago=40)
    ctx.store.delete(gone_already.storage_key)  # a crash between object and row: found again

    assert sorted(clean_up_inputs(ctx)) == sorted([old.id, gone_already.id])

    assert ctx.store.keys("inputs") == [recent.storage_key]
    with ctx.sessions() as s:
        assert [r.id for r in s.query(InputFile)] == [recent.id]
    assert clean_up_inputs(ctx) == []  # idempotent


def test_retention_of_zero_days_keeps_every_input(ctx: Context, tmp_path: Path) -> None:
    ctx.settings = make_settings(ctx.settings.database_url, ctx.settings.redis_prefix,
                                 tmp_path, retention_days=0)
    ancient = _uploaded(ctx, days_ago=3000)
    assert clean_up_inputs(ctx) == []
    assert ctx.store.exists(ancient.storage_key)
