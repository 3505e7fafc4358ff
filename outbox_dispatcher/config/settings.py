"""Every setting: environment variables with the OUTBOX_ prefix, overridden by CLI flags.

Read once, in the CLI; the supervisor builds each component's small config from them
(dispatch/supervisor.configs_of).
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from outbox_dispatcher.config import checks
from outbox_dispatcher.config.names import validate_identifier
from outbox_dispatcher.config.outboxes import SourceDefaults, parse_sources
from outbox_dispatcher.config.sources import FileVariablesSource, SecretsDirSource

CONSOLE_TOKEN_MIN_LENGTH = 16


class DeliveryMode(enum.StrEnum):
    """What a consumer sees of a row (docs/design/exactly-once.md)."""

    AT_LEAST_ONCE = "at-least-once"  # a crash or a takeover can publish a row again
    EXACTLY_ONCE = "exactly-once"  # Kafka transactions: once to read_committed consumers


class DeadLetterPolicy(enum.StrEnum):
    """What a dead-lettered row means for the later rows of its ordering key."""

    SKIP = "skip"  # later rows of the key go on
    BLOCK = "block"  # nothing later of the key is published until an operator acts


# Finite: `inf` would pass a bare `gt=0` and overflow a database interval later.
PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class Settings(BaseSettings):
    """Every setting of the dispatcher; `outbox-dispatcher run --help` lists the flags."""

    model_config = SettingsConfigDict(
        env_prefix="OUTBOX_",
        extra="ignore",
        validate_default=True,
        frozen=True,
        use_attribute_docstrings=True,  # each field's docstring is its --help
    )

    # Where
    database_url: SecretStr = SecretStr("postgresql://outbox:outbox@127.0.0.1:5432/outbox")
    """PostgreSQL URL of the database that holds the outbox table (a secret: use
    OUTBOX_DATABASE_URL_FILE or OUTBOX_SECRETS_DIR; percent-encode the password)."""
    db_schema: str = Field(
        default="public", validation_alias=AliasChoices("OUTBOX_SCHEMA", "db_schema")
    )
    """Schema of the outbox table."""
    table: str = "outbox"
    """Name of the outbox table."""
    sources: Annotated[SecretStr | None, NoDecode] = None
    """Many outboxes (issue 36): a JSON list of sources, each {"schema": a name or a pattern
    like "tenant_*", "table", "database_url", "name", "weight"}; unset: the one table above. A
    secret when it holds a database URL: use OUTBOX_SOURCES_FILE or OUTBOX_SECRETS_DIR."""
    max_connections: int = Field(default=0, ge=0, le=10_000)
    """With OUTBOX_SOURCES: the most PostgreSQL connections of the process over every database
    (pools, LISTEN, discovery, the idle probe and the fleet's membership); 0 means
    claim_tasks + 5 per database, and one."""
    kafka_bootstrap_servers: str = "127.0.0.1:9092"
    """Comma-separated Kafka bootstrap servers."""
    kafka_client_id: str = "outbox-dispatcher"
    """Kafka client id."""

    # How much at once
    claim_tasks: int = Field(default=2, ge=1, le=64)
    """Concurrent claim tasks."""
    fleet_in_flight_batches: int = Field(default=16, ge=1, le=1024)
    """With OUTBOX_SOURCES: the most batches on their way at once over every outbox of the
    process (claimed, not yet settled), shared by the outboxes with work through weighted
    deficit round-robin; at least OUTBOX_CLAIM_TASKS, the claims at once, whose number of them
    is kept for outboxes with no batch in flight (a backlog cannot hold them all)."""
    batch_size: int = Field(default=500, ge=1, le=10_000)
    """Rows per claim."""
    scan_factor: int = Field(default=2, ge=1, le=100)
    """Unused since the claim engine of schema version 6 (claims pick ready keys, not a window
    of the oldest rows); accepted so that existing configurations still start."""
    pool_size: int = Field(default=0, ge=0)
    """Database pool size; 0 means claim_tasks + 2."""

    # Timing
    lease_seconds: PositiveSeconds = 30.0
    """Lease length; extended every lease/3 while in flight."""
    poll_interval_seconds: PositiveSeconds = 0.5
    """Polling fallback when no notification arrives."""
    publish_timeout_seconds: PositiveSeconds = 20.0
    """Longest wait for the broker's acknowledgement of a batch (exactly-once: and no longer
    than 0.8 x transaction_timeout)."""
    shutdown_grace_seconds: PositiveSeconds = 20.0
    """On SIGTERM, time to finish in-flight batches before cancelling."""
    linger_seconds: Seconds = 1.0
    """Without LISTEN (listen=false): after a batch, keep polling every linger_poll_seconds this
    long, so that a steady flow does not wait for poll_interval. With LISTEN the dispatcher
    waits for writers' notifications instead."""
    linger_poll_seconds: PositiveSeconds = 0.01
    """Polling interval while lingering after a batch."""
    reclaim_interval_seconds: PositiveSeconds = 10.0
    """How often expired leases of crashed dispatchers are swept."""
    sweep_rows: int = Field(default=10_000, ge=0)
    """Ids the anti-entropy sweep walks every reclaim interval (0: off). It finds pending rows
    that reached the table around the claim engine's bookkeeping (ids written below its cursor,
    a restore with triggers off) and hands them to the claims; a whole pass takes table rows /
    sweep_rows reclaim intervals."""

    # Failures
    max_attempts: int = Field(default=10, ge=1)
    """Failed attempts after which a row is dead-lettered."""
    backoff_initial_seconds: PositiveSeconds = 0.5
    """First retry delay; doubles per failed attempt, with jitter."""
    backoff_max_seconds: PositiveSeconds = 30.0
    """Longest retry delay (also the longest pause in an outage)."""
    dead_letter_policy: DeadLetterPolicy = DeadLetterPolicy.SKIP
    """After a row of a key is dead-lettered: 'skip' publishes the key's later rows, 'block'
    holds them until an operator requeues or discards the dead row."""

    # Kafka record shape and producer
    default_topic: str | None = None
    """Topic for rows whose topic is NULL and no template applies."""
    topic_template: str | None = None
    """Topic for rows whose topic is NULL, from their headers: e.g. 'events.{aggregate}' uses
    the row's 'aggregate' header."""
    event_id_header: str = Field(default="event-id", min_length=1)
    """Kafka header that carries the event id."""
    kafka_linger_ms: int = Field(default=2, ge=0)
    """Producer linger: how long a batch waits for more records."""
    kafka_max_batch_bytes: int = Field(default=262_144, ge=1024)
    """Producer batch size per partition, in bytes."""
    kafka_max_request_bytes: int = Field(default=1_048_576, ge=1024)
    """Largest record the producer sends; larger rows are dead-lettered."""
    kafka_compression: Literal["none", "gzip", "lz4", "zstd", "snappy"] = "none"
    """Producer compression."""

    # Delivery (docs/design/exactly-once.md)
    delivery: DeliveryMode = DeliveryMode.AT_LEAST_ONCE
    """'at-least-once': a crash between the broker's acknowledgement and the mark, or a lease
    taken over, publishes a row again (consumers deduplicate by the event id). 'exactly-once':
    each batch is one Kafka transaction with a progress record, and a takeover fences the other
    dispatchers' transactions and reads the progress first: no row reaches a read_committed
    consumer twice."""
    progress_topic: str = Field(default="outbox-dispatcher.progress", min_length=1)
    """exactly-once: the compacted topic of progress records (created at start if missing)."""
    transactional_id_prefix: str = Field(default="outbox-dispatcher.", min_length=1)
    """exactly-once: each dispatcher's transactional ids are this prefix, the table and its lane
    names (a Kafka ACL on this prefix grants them)."""
    transaction_timeout_seconds: PositiveSeconds = 10.0
    """exactly-once: the broker aborts a transaction open longer than this (it must end
    before the lease, OUTBOX_LEASE_SECONDS); a transaction's acks are waited for 0.8 x this at
    most (and publish_timeout at most) before it is given up."""
    progress_sweep_seconds: PositiveSeconds = 60.0
    """exactly-once: how often (jittered by half either way) each dispatcher ends the progress
    keys of the table's dispatchers that stopped beating while they held no lease."""
    lanes_idle_seconds: PositiveSeconds = 180.0
    """exactly-once with OUTBOX_SOURCES: an outbox's lanes (transactional producers), opened at
    its first batch, are closed once it has been idle this long (nothing in flight, every
    batch marked), so that idle outboxes hold no producer."""
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """Kafka security protocol."""
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    """SASL mechanism, with username and password."""
    kafka_sasl_username: str | None = None
    """SASL username."""
    kafka_sasl_password: SecretStr | None = None
    """SASL password (a secret: use OUTBOX_KAFKA_SASL_PASSWORD_FILE)."""
    kafka_ssl_cafile: str | None = None
    """CA bundle that verifies the broker's certificate."""
    kafka_ssl_certfile: str | None = None
    """Client certificate (PEM) for brokers that require one."""
    kafka_ssl_keyfile: str | None = None
    """Private key (PEM) of the client certificate."""
    kafka_ssl_key_password: SecretStr | None = None
    """Password of the client certificate's private key, if any (a secret: use
    OUTBOX_KAFKA_SSL_KEY_PASSWORD_FILE)."""
    kafka_ssl_check_hostname: bool = True
    """Verify that the broker's certificate names its host."""
    kafka_allow_auto_create_topics: bool = True
    """Let the broker auto-create a missing topic (if it is configured to). When false, the
    dispatcher looks topics up without auto-creation, and a row for a missing topic is retried,
    then dead-lettered, with a message saying to create it."""

    # Database session
    listen: bool = True
    """Use LISTEN/NOTIFY as a wake-up hint."""
    listen_database_url: SecretStr | None = None
    """Direct URL for LISTEN when database_url goes through a transaction pooler (a secret: use
    OUTBOX_LISTEN_DATABASE_URL_FILE)."""
    synchronous_commit: Literal["on", "off", "local"] | None = None
    """synchronous_commit for the dispatcher's own transactions. Unset: off with at-least-once
    (a mark a database crash loses only means a re-publish, which it allows), on with
    exactly-once (a batch's progress record forgets it once it is marked: a lost mark would send
    it again). exactly-once refuses off."""

    delete_on_publish: bool = False
    """Delete rows once the broker acknowledged them instead of marking them published: less
    write amplification, but no record of what was published (nothing to replay)."""
    statement_cache_size: int = Field(default=100, ge=0)
    """asyncpg's prepared-statement cache per connection; 0 behind a transaction pooler without
    prepared-statement support."""

    # Table hygiene
    retention_seconds: Seconds = 7 * 24 * 3600
    """Delete published rows older than this (dead rows are kept for operators); 0 keeps them
    forever."""
    cleanup_interval_seconds: PositiveSeconds = 60.0
    """How often the retention loop looks for old published rows."""
    cleanup_batch_size: int = Field(default=1000, ge=1, le=100_000)
    """Rows deleted per retention transaction (bounds lock time and WAL bursts)."""
    action_batch_size: int | None = Field(default=None, ge=1, le=100_000)
    """Rows per batch of dead requeue/discard and replay (CLI and console); unset:
    OUTBOX_CLEANUP_BATCH_SIZE."""

    # Observability
    http_host: str = "0.0.0.0"  # noqa: S104 - probes and scrapes come from outside the pod
    """Address of the /metrics, /livez and /readyz endpoint. The default, every IPv4 interface,
    is what Kubernetes probes and Prometheus need (they reach the pod's address); the endpoint
    serves no secrets, but on a shared host or without a NetworkPolicy set 127.0.0.1 (or '::'
    for IPv6)."""
    http_port: int = Field(default=9646, ge=0, le=65535)
    """Port of the /metrics, /livez and /readyz endpoint; 0 picks a free port."""
    http_enabled: bool = True
    """Serve /metrics, /livez and /readyz."""
    liveness_timeout_seconds: PositiveSeconds = 120.0
    """/livez fails when a loop has not made progress for this long."""
    metrics_interval_seconds: PositiveSeconds = 15.0
    """How often the outbox's pending/dead/blocked gauges are read from the table."""
    metrics_max_sources: int = Field(default=100, ge=0, le=10_000)
    """With OUTBOX_SOURCES: the most outboxes with a `source` label of their own in this
    process's metrics (the first served; the rest share source="other", whose table gauges are
    not sampled); 0: every outbox under "other"."""
    fleet_hot_seconds: PositiveSeconds = 5.0
    """With OUTBOX_SOURCES and several processes: an outbox whose claims have seen more rows
    than they took for this long is listed as hot by its owner, and the next process in its
    hash order serves it too until a claim sees its end."""
    cloudevents: bool = False
    """Add CloudEvents binary-mode headers (ce_id = event id, ce_source, ce_type,
    ce_specversion, ce_time, content-type); a row's own ce_* headers win."""
    cloudevents_source: str = Field(default="outbox-dispatcher", min_length=1)
    """ce_source when the row has none."""
    cloudevents_type: str = Field(default="outbox.event", min_length=1)
    """ce_type when the row has none."""
    cloudevents_content_type: str = Field(default="application/json", min_length=1)
    """content-type when the row has none."""
    tracing: bool = False
    """Record an OpenTelemetry producer span per record, linked to the row's traceparent (needs
    the 'otel' extra and an OTEL_* configured SDK)."""

    # The operator console (`outbox-dispatcher console`)
    console_host: str = "127.0.0.1"
    """Address of the operator console (`outbox-dispatcher console`). The default serves this
    machine only; to reach it from elsewhere, put it behind a TLS proxy."""
    console_port: int = Field(default=9647, ge=0, le=65535)
    """Port of the operator console."""
    console_token: SecretStr | None = None
    """Token of the console's people: the password of its login form and the Bearer token of its
    API, which let them read and act (requeue, discard, replay, pause, resume). A secret: use
    OUTBOX_CONSOLE_TOKEN_FILE or OUTBOX_SECRETS_DIR; random, at least 16 characters (e.g.
    `openssl rand -hex 32`)."""
    console_anonymous_read: bool = False
    """Let anyone who reaches the console read it without logging in (counts, keys, errors,
    headers; never payloads or actions): a read-only anonymous console."""
    console_allowed_hosts: str | None = None
    """Host names (comma-separated) the console answers to, in the Host header (against DNS
    rebinding); default: OUTBOX_CONSOLE_HOST, 127.0.0.1, localhost and ::1. Add the name a proxy
    or browser uses to reach it."""
    console_trusted_proxies: str | None = None
    """Addresses or networks (comma-separated) of proxies whose X-Forwarded-User header names
    the person (logged in as them, recorded in the audit) and whose X-Forwarded-For names the
    client; the header from anyone else is ignored."""
    console_show_payload: bool = False
    """Show row payloads in the console (off: a payload never leaves the database)."""
    console_payload_max_bytes: int = Field(default=16_384, ge=1, le=1_048_576)
    """With console_show_payload, the most bytes of a payload the console shows."""
    console_sample_seconds: PositiveSeconds = 10.0
    """How often the console samples the backlog for its last-hour chart (kept in the console's
    memory only)."""

    # Process
    uvloop: bool = True
    """Run on uvloop where it is installed."""
    log_format: Literal["json", "console"] = "json"
    """Log lines as JSON objects, or for a terminal."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level."""

    @field_validator("database_url", "listen_database_url")
    @classmethod
    def _check_database_url(cls, value: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        if value is not None:
            checks.database_url(value.get_secret_value(), info.field_name or "database_url")
        return value

    @field_validator("console_token")
    @classmethod
    def _check_console_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            checks.console_token(value.get_secret_value())
        return value

    @field_validator("console_trusted_proxies")
    @classmethod
    def _check_trusted_proxies(cls, value: str | None) -> str | None:
        checks.trusted_proxies(value)
        return value

    @field_validator("sources")
    @classmethod
    def _check_sources(cls, value: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        """Parsed here so that a bad list fails at start, with config/outboxes.py's messages
        (a ConfigurationError, never a ValidationError: pydantic's text quotes the input)."""
        if value is not None and {"database_url", "db_schema", "table"} <= info.data.keys():
            defaults = SourceDefaults(
                info.data["database_url"], info.data["db_schema"], info.data["table"]
            )
            parse_sources(value.get_secret_value(), "OUTBOX_SOURCES", defaults)
        return value

    _check_schema = field_validator("db_schema")(checks.schema)
    _check_bootstrap = field_validator("kafka_bootstrap_servers")(checks.bootstrap_servers)

    @field_validator("table")
    @classmethod
    def _check_table(cls, value: str) -> str:
        return validate_identifier(value, "OUTBOX_TABLE")

    @field_validator("default_topic", "topic_template")
    @classmethod
    def _check_topics(cls, value: str | None, info: ValidationInfo) -> str | None:
        return checks.topic_setting(value, template=info.field_name == "topic_template")

    @property
    def commit_durability(self) -> str:
        """The synchronous_commit the dispatcher's sessions run with (see synchronous_commit)."""
        if self.synchronous_commit is not None:
            return self.synchronous_commit
        return "on" if self.delivery is DeliveryMode.EXACTLY_ONCE else "off"

    @model_validator(mode="after")
    def _check_relations(self) -> Settings:
        checks.relations(self)
        checks.kafka_security(self)
        if self.sources is not None and self.fleet_in_flight_batches < self.claim_tasks:
            msg = (
                f"OUTBOX_FLEET_IN_FLIGHT_BATCHES={self.fleet_in_flight_batches} is below "
                f"OUTBOX_CLAIM_TASKS={self.claim_tasks}: with OUTBOX_SOURCES each claim holds a "
                "batch in flight; raise OUTBOX_FLEET_IN_FLIGHT_BATCHES to at least "
                f"{self.claim_tasks} or lower OUTBOX_CLAIM_TASKS"
            )
            raise ValueError(msg)
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Precedence, first wins: flags (init), OUTBOX_* variables, OUTBOX_*_FILE variables,
        files in OUTBOX_SECRETS_DIR, defaults."""
        return (
            init_settings,
            env_settings,
            FileVariablesSource(settings_cls),
            SecretsDirSource(settings_cls),
        )

    @property
    def effective_action_batch_size(self) -> int:
        return self.action_batch_size or self.cleanup_batch_size

    @property
    def effective_pool_size(self) -> int:
        return self.pool_size or self.claim_tasks + 2
