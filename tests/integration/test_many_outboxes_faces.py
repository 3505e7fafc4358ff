"""The faces of many outboxes (issue 36, OUTBOX_SOURCES) against real PostgreSQL and Kafka: the
metrics of a fleet process carry a bounded `source` label; `status` lists every outbox of every
source and filters them; the operator commands act on the one outbox a filter names and refuse,
listing the choices, when it names none or several."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .helpers import (
    Services,
    http_get,
    log_events,
    spawn,
    stop_all,
    wait_started,
    wait_until,
)
from .sources_helpers import migrate
from .test_many_outboxes import MakeTopic, Tenant, databases, fleet_settings

pytestmark = [pytest.mark.integration, pytest.mark.slow]
__all__ = ["databases"]  # the fixture, shared with test_many_outboxes


def samples(exposition: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of one series name, by their labels."""
    found: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def by_source(found: dict[tuple[tuple[str, str], ...], float]) -> dict[str, float]:
    """Sample values summed per `source` label (KeyError: a sample without one)."""
    summed: dict[str, float] = {}
    for labels, value in found.items():
        source = dict(labels)["source"]
        summed[source] = summed.get(source, 0.0) + value
    return summed


async def test_fleet_metrics_carry_a_bounded_source_label(
    services: Services,
    databases: tuple[str, str],
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    a, b = databases
    await migrate(a, "tenant_a", "tenant_b", "tenant_c")
    await migrate(b, "public")
    tenants = [Tenant(a, f"tenant_{t}", await make_topic()) for t in "abc"]
    tenants.append(Tenant(b, "public", await make_topic()))
    rows = {"tenant_a.outbox": 10, "tenant_b.outbox": 20, "tenant_c.outbox": 30, "shard_b": 40}
    settings = fleet_settings(
        make_settings,
        a,
        [{"schema": "tenant_*"}, {"schema": "public", "database_url": b, "name": "shard_b"}],
        metrics_max_sources=2,
        metrics_interval_seconds=0.2,
    )
    log = tmp_path / "fleet.log"
    process = spawn(settings, log)
    try:
        await wait_started([log])
        for tenant, n in zip(tenants, rows.values(), strict=True):
            await tenant.insert(keys=n, per_key=1)
        for tenant in tenants:
            await tenant.all_published()
        (listening,) = log_events(log, "http_listening")
        exposition = ""

        async def sampled_since() -> bool:  # the table gauges read after the last publish
            nonlocal exposition
            status, body = await http_get(listening["port"], "/metrics")
            assert status == 200
            exposition = body.decode()
            pending = samples(exposition, "outbox_pending_rows")
            return bool(pending) and not any(pending.values())

        await wait_until(sampled_since, 30, "the table gauges sampled at 0 pending")
    finally:
        codes = stop_all([process])
    assert codes == [0], log.read_text()[-3000:]
    published = by_source(samples(exposition, "outbox_published_total"))
    own = set(published) - {"other"}
    # Two outboxes have a label of their own (the bound), the other two share "other".
    assert len(own) == 2 and own <= set(rows), published
    assert published["other"] == sum(n for label, n in rows.items() if label not in own)
    for label in own:
        assert published[label] == rows[label], (label, published)
    claimed = by_source(samples(exposition, "outbox_claimed_rows_total"))
    assert claimed == published, (claimed, published)
    histogram = samples(exposition, "outbox_commit_to_ack_seconds_count")
    assert by_source(histogram) == published
    # The table gauges: sampled under each own label (pending 0 by now), none for "other".
    pending = by_source(samples(exposition, "outbox_pending_rows"))
    assert set(pending) == own, pending
    lag = samples(exposition, "outbox_oldest_pending_age_seconds")
    assert {dict(k)["source"] for k in lag} == own
    # The process's own series keep no source label.
    assert samples(exposition, "outbox_ready") == {(): 1.0}
    assert all("source" not in dict(k) for k in samples(exposition, "outbox_in_flight_rows"))


async def test_single_table_metrics_keep_no_source_label(
    services: Services, make_topic: MakeTopic, make_settings: Any, tmp_path: Path
) -> None:
    """Without OUTBOX_SOURCES the series are as before (the dashboards' and alerts')."""
    settings = make_settings(log_format="json", metrics_interval_seconds=0.2)
    log = tmp_path / "one.log"
    process = spawn(settings, log)
    try:
        await wait_started([log])
        (listening,) = log_events(log, "http_listening")
        _, body = await http_get(listening["port"], "/metrics")
    finally:
        stop_all([process])
    exposition = body.decode()
    assert () in samples(exposition, "outbox_pending_rows")
    assert "source=" not in exposition
