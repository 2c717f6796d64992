"""The Celery app of the environment's settings, for Celery's own command line:
``celery -A kiln.celery_app inspect ping`` (docker-compose's healthcheck) or
``celery -A kiln.celery_app worker``. kiln's own entry points build theirs with
`kiln.tasks.make_celery`."""

from __future__ import annotations

from celery import Celery

from common.settings import get_settings
from kiln.tasks import make_celery

app: Celery = make_celery(get_settings())
