"""Which records of a claim go out together: waves, each sent and acknowledged before the next."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from outbox_dispatcher.kafka.records import BATCH_HEADER, partition_in, record_size
from outbox_dispatcher.models import OutboxRecord


def plan_waves(
    records: Sequence[OutboxRecord],
    topics: Sequence[str | BaseException],
    batch_bytes: int = 1 << 62,
    partitions: Callable[[str], set[int] | None] = lambda topic: None,
    extra: int = 0,
    sizes: Sequence[int] | None = None,
) -> list[list[int]]:
    """Record indices by wave (each wave is sent, then awaited, before the next).

    A key's rows stay in its current wave while their topic stays the same (one partition,
    ordered by the producer) and move to the next wave at each change of topic (F1). A wave
    holds at most one producer batch (`batch_bytes`) per partition, so that a key's rows never
    straddle two producer batches of one partition in flight at once: a batch that expires
    unsent uses up sequence numbers, and a broker without state for the producer id would
    accept the next batch, delivering later rows first (review F3). Keyless rows have no order
    to keep; the publisher puts a wave's keyless rows of a topic in any one partition of it,
    so their bytes count against every partition of it. `sizes`: each record's bytes in a batch
    at most (KafkaRecord.size), else estimated from the row (record_size, plus `extra`)."""
    limit = max(1, batch_bytes - BATCH_HEADER)
    if sizes is None:
        sizes = [
            record_size(r, extra) if isinstance(t, str) else 0
            for r, t in zip(records, topics, strict=True)
        ]
    if sum(sizes) <= limit:
        limit = 1 << 62  # the whole claim fits in one batch per partition: no byte accounting
    waves: list[list[int]] = []
    at: dict[str, tuple[int, str | BaseException]] = {}
    keyed: dict[tuple[str, int | str, int], int] = {}  # (topic, partition, wave): bytes
    busiest: dict[tuple[str, int], int] = {}  # (topic, wave): the most keyed bytes of a partition
    keyless: dict[tuple[str, int], int] = {}  # (topic, wave): bytes
    partition_cache: dict[tuple[str, str], int | str] = {}
    ordered: dict[str, list[int] | None] = {}  # topic: its partitions by id
    for i, (record, topic) in enumerate(zip(records, topics, strict=True)):
        key = record.ordering_key
        wave = 0
        if key is not None:
            previous = at.get(key)
            if previous is not None:
                wave, previous_topic = previous
                if previous_topic != topic:
                    wave += 1
        if isinstance(topic, str) and limit < 1 << 62:
            size = sizes[i]
            if key is None:
                while (used := keyless.get((topic, wave), 0) + busiest.get((topic, wave), 0)) and (
                    used + size > limit
                ):
                    wave += 1
                keyless[(topic, wave)] = keyless.get((topic, wave), 0) + size
            else:
                partition = partition_cache.get((topic, key))
                if partition is None:
                    if topic not in ordered:
                        known = partitions(topic)
                        ordered[topic] = sorted(known) if known else None
                    candidates = ordered[topic]
                    partition = partition_in(candidates, key) if candidates else key
                    partition_cache[(topic, key)] = partition
                while (
                    used := keyed.get((topic, partition, wave), 0) + keyless.get((topic, wave), 0)
                ) and used + size > limit:
                    wave += 1
                load = keyed.get((topic, partition, wave), 0) + size
                keyed[(topic, partition, wave)] = load
                busiest[(topic, wave)] = max(busiest.get((topic, wave), 0), load)
        if key is not None:
            at[key] = (wave, topic)
        while wave >= len(waves):
            waves.append([])
        waves[wave].append(i)
    return waves
