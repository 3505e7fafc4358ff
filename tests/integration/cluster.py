"""The three-broker KRaft cluster of deploy/local/services.sh (cluster-start), for the tests that
need a partition to lose its leader while the cluster still answers.

One `Cluster` per test run (the `kafka_cluster` session fixture in conftest.py starts it when a
test first asks for it and stops it at the end); the `cluster` fixture hands it to a test and,
whatever the test did, brings every broker back before the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError
from aiokafka.protocol.admin import AlterConfigsRequest

BROKERS = (1, 2, 3)


@dataclass(frozen=True)
class PartitionState:
    leader: int  # -1: no leader
    replicas: tuple[int, ...]
    isr: tuple[int, ...]


@dataclass(frozen=True)
class LogBatch:
    """One record batch of a partition's log, as DumpLogSegments prints it."""

    base_offset: int
    last_offset: int
    producer_id: int
    producer_epoch: int
    base_sequence: int

    @staticmethod
    def parse(line: str) -> LogBatch | None:
        if not line.startswith("baseOffset:"):
            return None
        words = line.split()
        fields = dict(zip(words[0::2], words[1::2], strict=False))
        return LogBatch(
            int(fields["baseOffset:"]),
            int(fields["lastOffset:"]),
            int(fields["producerId:"]),
            int(fields["producerEpoch:"]),
            int(fields["baseSequence:"]),
        )

    def __str__(self) -> str:
        return (
            f"offsets {self.base_offset}-{self.last_offset}: producer id {self.producer_id}, "
            f"epoch {self.producer_epoch}, base sequence {self.base_sequence}"
        )


@dataclass
class Cluster:
    bootstrap: str
    control: Path
    topics: list[str] = field(default_factory=list)
    # node -> (its PROXIED listener's port, the port it advertises there, where a test runs a
    # fault proxy to that listener): a client bootstrapped at the proxies reaches each node only
    # through its proxy. Empty when the script runs without those listeners.
    proxied: dict[int, tuple[int, int]] = field(default_factory=dict)
    paused: set[int] = field(default_factory=set)

    @staticmethod
    def parse_proxied(text: str) -> dict[int, tuple[int, int]]:
        """services.sh cluster-env's OUTBOX_CLUSTER_PROXIED: node:proxied:proxy,..."""
        found: dict[int, tuple[int, int]] = {}
        for item in filter(None, text.split(",")):
            node, proxied, proxy = (int(part) for part in item.split(":"))
            found[node] = (proxied, proxy)
        return found

    async def _run(self, *args: str) -> None:
        command = ["bash", str(self.control), *args]
        await asyncio.to_thread(subprocess.run, command, check=True, timeout=180)

    async def _output(self, *args: str) -> str:
        command = ["bash", str(self.control), *args]
        done = await asyncio.to_thread(
            subprocess.run, command, check=True, timeout=180, capture_output=True, text=True
        )
        return done.stdout

    async def stop(self, broker: int) -> None:
        """Controlled shutdown (SIGTERM): the broker hands its leaderships over first."""
        await self._run("broker-stop", str(broker))

    async def kill(self, broker: int) -> None:
        """SIGKILL: no controlled shutdown; the controller fences it after its session timeout."""
        await self._run("broker-kill", str(broker))

    async def start(self, broker: int) -> None:
        await self._run("broker-start", str(broker))

    async def start_all(self) -> None:
        for broker in sorted(self.paused):
            await self.resume(broker)
        for broker in BROKERS:
            await self.start(broker)

    async def pause(self, broker: int) -> None:
        """SIGSTOP: the broker stops answering and fetching but keeps its state, as a long GC
        pause or a frozen VM would; resume() (or the next test's start_all) continues it."""
        await self._run("broker-pause", str(broker))
        self.paused.add(broker)

    async def resume(self, broker: int) -> None:
        await self._run("broker-resume", str(broker))
        self.paused.discard(broker)

    async def quorum_leader(self) -> int:
        """The active controller's node id (a broker paused while it leads the quorum would
        hold up every metadata change, topic configs included, until a new leader is elected)."""
        return int((await self._output("quorum-leader")).strip())

    async def log_batches(self, broker: int, topic: str, partition: int) -> list[LogBatch]:
        """The partition's record batches as `broker` wrote them to its log (DumpLogSegments):
        the broker's view of who wrote what, for telling copies apart."""
        text = await self._output("dump-log", str(broker), topic, str(partition))
        return [batch for line in text.splitlines() if (batch := LogBatch.parse(line))]

    @contextlib.asynccontextmanager
    async def admin(self) -> AsyncIterator[AIOKafkaAdminClient]:
        client = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=10_000)
        await client.start()
        try:
            yield client
        finally:
            await client.close()

    async def partitions(self, topic: str) -> dict[int, PartitionState]:
        """Leader, replicas and in-sync replicas of each partition, from a broker's metadata
        (asked again for a while if the broker asked has just gone away)."""
        deadline = time.monotonic() + 20
        while True:
            try:
                async with self.admin() as admin:
                    described = await admin.describe_topics([topic])
                break
            except (KafkaError, OSError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.3)
        found: dict[int, PartitionState] = {}
        for entry in described:
            if entry["topic"] != topic:
                continue
            for p in entry["partitions"]:
                found[p["partition"]] = PartitionState(
                    p["leader"], tuple(p["replicas"]), tuple(p["isr"])
                )
        return found

    async def leader(self, topic: str, partition: int) -> int:
        return (await self.partitions(topic))[partition].leader

    async def wait_for(self, topic: str, what: str, ok: Any, timeout: float = 60.0) -> None:
        """Until `ok(partitions)` holds for the topic's metadata (every broker's view converges
        within moments; metadata is read from any broker)."""
        deadline = time.monotonic() + timeout
        last: dict[int, PartitionState] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # a broker just stopped: ask again
                last = await self.partitions(topic)
                if last and ok(last):
                    return
            await asyncio.sleep(0.3)
        msg = f"timed out after {timeout}s waiting for {what} of {topic}: {last}"
        raise AssertionError(msg)

    async def wait_fully_replicated(self, topic: str, timeout: float = 60.0) -> None:
        await self.wait_for(
            topic,
            "every replica in sync",
            lambda ps: all(p.leader >= 0 and set(p.isr) == set(p.replicas) for p in ps.values()),
            timeout,
        )

    async def create_topic(
        self,
        *,
        partitions: int = 3,
        replication: int = 3,
        config: Mapping[str, str] | None = None,
        assignments: Mapping[int, Sequence[int]] | None = None,
        prefix: str = "cluster",
    ) -> str:
        """A unique topic (deleted at the end of the test), once every replica is in sync.
        With `assignments` (partition -> brokers) the replicas are placed by hand."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        if assignments is not None:
            topic = NewTopic(
                name,
                num_partitions=-1,
                replication_factor=-1,
                replica_assignments={p: list(b) for p, b in assignments.items()},
                topic_configs=dict(config or {}),
            )
        else:
            topic = NewTopic(name, partitions, replication, topic_configs=dict(config or {}))
        async with self.admin() as admin:
            response = await admin.create_topics([topic])
        errors = [e for e in response.topic_errors if e[1] != 0]
        assert not errors, errors
        self.topics.append(name)
        await self.wait_fully_replicated(name)
        return name

    async def set_topic_config(
        self, topic: str, config: Mapping[str, str], *, via: int | None = None
    ) -> None:
        """Replace the topic's configuration (AlterConfigs: what `config` leaves out returns to
        the broker's default). `via`: the broker asked (the admin client otherwise asks a random
        one, which may be a paused broker that never answers)."""
        resource = ConfigResource(ConfigResourceType.TOPIC, topic, configs=dict(config))
        async with self.admin() as admin:
            if via is None:
                responses = await admin.alter_configs([resource])
            else:
                entry = (resource.resource_type.value, topic, list(config.items()))
                request = AlterConfigsRequest(resources=[entry])
                responses = [await admin._send_request(request, via)]
        for response in responses:
            for resource_error in response.resources:
                assert resource_error[0] == 0, resource_error

    async def delete_topics(self) -> None:
        """Once every replica is back in sync (bounded): Kafka 4.1.1's controller kept a topic
        deleted while a broker was out of its ISR in that broker's index, and refused the
        broker's next registration (UNKNOWN_SERVER_ERROR, "existed in isrMembers, but not in
        the topics map"): the broker could never start again."""
        if not self.topics:
            return
        for topic in self.topics:
            with contextlib.suppress(AssertionError):
                await self.wait_fully_replicated(topic, timeout=30)
        with contextlib.suppress(Exception):
            async with self.admin() as admin:
                await admin.delete_topics(self.topics)
        self.topics.clear()

    async def wait_all_brokers(self, timeout: float = 60.0) -> None:
        """Until the metadata lists every broker (a restarted one is registered and unfenced)."""
        deadline = time.monotonic() + timeout
        seen: set[int] = set()
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                async with self.admin() as admin:
                    described = await admin.describe_cluster()
                seen = {b["node_id"] for b in described["brokers"]}
                if seen == set(BROKERS):
                    return
            await asyncio.sleep(0.3)
        msg = f"timed out after {timeout}s waiting for brokers {BROKERS}; metadata lists {seen}"
        raise AssertionError(msg)
