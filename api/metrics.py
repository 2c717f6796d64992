"""Prometheus metrics, read from the database at scrape time.

Computing them from the rows (not from in-process counters) means every API replica reports the
same numbers, including work done by worker processes that export nothing themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import psutil
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from common.settings import Settings
from storage import stats, workers
from storage.tables import MAX_PRIORITY, MIN_PRIORITY, JobClass, JobState

log = logging.getLogger(__name__)


class KilnCollector(Collector):
    def __init__(self, session_factory: sessionmaker[Session], settings: Settings) -> None:
        self.session_factory = session_factory
        self.settings = settings

    def collect(self) -> Iterator[Metric]:
        yield from self._host()
        try:
            with self.session_factory() as session:
                yield from self._from_db(session)
        except SQLAlchemyError:
            # A scrape must not fail because the database blinked; /readyz reports that.
            log.warning("metrics: database unavailable", exc_info=True)

    def _from_db(self, session: Session) -> Iterator[Metric]:
        depth = stats.queue_depth(session)
        queue = GaugeMetricFamily("kiln_queue_depth", "Queued jobs by class and priority",
                                  labels=["class", "priority"])
        for job_class in JobClass:
            for priority in range(MIN_PRIORITY, MAX_PRIORITY + 1):
                queue.add_metric([job_class.value, str(priority)],
                                 depth.get((job_class.value, priority), 0))
        yield queue

        by_state = stats.jobs_by_state(session)
        states = GaugeMetricFamily("kiln_jobs", "Jobs by state", labels=["state"])
        for state in JobState:
            states.add_metric([state.value], by_state.get(state.value, 0))
        yield states

        buckets, count, total = stats.render_seconds_histogram(session)
        histogram = HistogramMetricFamily(
            "kiln_render_seconds", "Render time of succeeded jobs (claim to finish)")
        bounds = [str(b) for b in stats.RENDER_SECONDS_BUCKETS] + ["+Inf"]
        histogram.add_metric([], list(zip(bounds, [*buckets, count], strict=True)), total)
        yield histogram

        yield GaugeMetricFamily("kiln_videos_last_hour", "Videos finished in the last hour",
                                value=stats.videos_last_hour(session))

        groups = workers.list_groups(session,
                                     stale_after_seconds=self.settings.worker_stale_seconds)
        used = GaugeMetricFamily("kiln_device_memory_used_bytes", "Device memory in use per rank",
                                 labels=["group", "rank"])
        capacity = GaugeMetricFamily("kiln_device_memory_total_bytes",
                                     "Device memory per rank", labels=["group", "rank"])
        host = GaugeMetricFamily("kiln_rank_host_memory_bytes",
                                 "Host memory held by each rank", labels=["group", "rank"])
        for group, stale in groups:
            if stale:
                continue
            for entry in group.ranks:
                labels = [group.id, str(entry.get("rank"))]
                for family, key in ((used, "device_mem_used_bytes"),
                                    (capacity, "device_mem_total_bytes"),
                                    (host, "host_mem_bytes")):
                    value = entry.get(key)
                    if isinstance(value, int | float):
                        family.add_metric(labels, value)
        yield used
        yield capacity
        yield host

    def _host(self) -> Iterator[Metric]:
        vm = psutil.virtual_memory()
        yield GaugeMetricFamily("kiln_host_memory_total_bytes", "Host memory of the API machine",
                                value=vm.total)
        yield GaugeMetricFamily("kiln_host_memory_available_bytes",
                                "Available host memory of the API machine", value=vm.available)


def make_registry(session_factory: sessionmaker[Session], settings: Settings) -> CollectorRegistry:
    # A registry per app (not the global one) so several apps in one process don't collide.
    registry = CollectorRegistry()
    registry.register(KilnCollector(session_factory, settings))
    return registry
