"""Checks across settings that pydantic's per-field validation cannot express."""

from __future__ import annotations

import ipaddress
from typing import Protocol

from pydantic import SecretStr

from outbox_dispatcher import routing
from outbox_dispatcher.config.names import (
    PERCENT_ENCODE,
    RESERVED_SCHEMAS,
    database_url_problem,
    env_name,
    split_list,
    validate_identifier,
)

# Exactly-once's progress record (kafka/exactly_once/progress.py): its bytes beyond its (id,
# replays) pairs (the outbox and owner names up to about 700 bytes, a batch's tag, punctuation, the
# key and Kafka's record and batch headers), and a pair's at most ("[<bigint>,<int>],").
PROGRESS_RECORD_OVERHEAD_BYTES = 1024
PROGRESS_PAIR_BYTES_AT_MOST = 33


def progress_record_bytes_at_most(batch_size: int, names: int) -> int:
    """The largest progress record of one batch of `batch_size` rows (`names`: the bytes of the
    transactional id prefix and the outbox's names)."""
    return PROGRESS_RECORD_OVERHEAD_BYTES + names + batch_size * PROGRESS_PAIR_BYTES_AT_MOST


class Choices(Protocol):
    """The settings the checks across settings read (config/settings.Settings has them)."""

    @property
    def backoff_initial_seconds(self) -> float: ...
    @property
    def backoff_max_seconds(self) -> float: ...
    @property
    def delivery(self) -> str: ...
    @property
    def lease_seconds(self) -> float: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def kafka_max_request_bytes(self) -> int: ...
    @property
    def transactional_id_prefix(self) -> str: ...
    @property
    def db_schema(self) -> str: ...
    @property
    def table(self) -> str: ...
    @property
    def transaction_timeout_seconds(self) -> float: ...
    @property
    def synchronous_commit(self) -> str | None: ...
    @property
    def kafka_security_protocol(self) -> str: ...
    @property
    def kafka_sasl_mechanism(self) -> str | None: ...
    @property
    def kafka_sasl_username(self) -> str | None: ...
    @property
    def kafka_sasl_password(self) -> SecretStr | None: ...
    @property
    def kafka_ssl_cafile(self) -> str | None: ...
    @property
    def kafka_ssl_certfile(self) -> str | None: ...
    @property
    def kafka_ssl_keyfile(self) -> str | None: ...
    @property
    def kafka_ssl_key_password(self) -> SecretStr | None: ...


CONSOLE_TOKEN_MIN_LENGTH = 16


def database_url(dsn: str, field: str) -> None:
    if problem := database_url_problem(dsn):
        msg = (
            f"{env_name(field)} is not a usable PostgreSQL URL ({problem}): expected "
            f"postgresql://user:password@host:port/database[?option=value]; {PERCENT_ENCODE}"
        )
        raise ValueError(msg)


def console_token(token: str) -> None:
    if len(token) < CONSOLE_TOKEN_MIN_LENGTH:
        msg = (
            f"OUTBOX_CONSOLE_TOKEN must be at least {CONSOLE_TOKEN_MIN_LENGTH} characters "
            "(e.g. the output of `openssl rand -hex 32`)"
        )
        raise ValueError(msg)


def trusted_proxies(value: str | None) -> None:
    for item in split_list(value):
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            msg = f"OUTBOX_CONSOLE_TRUSTED_PROXIES: {item!r} is not an address or network"
            raise ValueError(msg) from None


def schema(value: str) -> str:
    validate_identifier(value, "OUTBOX_SCHEMA")
    if value in RESERVED_SCHEMAS or value.startswith("pg_"):
        msg = f"OUTBOX_SCHEMA {value!r} is a system schema (or the fleet's); choose another"
        raise ValueError(msg)
    return value


def bootstrap_servers(value: str) -> str:
    servers = [s.strip() for s in value.split(",") if s.strip()]

    def usable(server: str) -> bool:
        host, _, port = server.rpartition(":")
        return bool(host.strip("[]")) and port.isdigit() and 0 < int(port) < 65536

    if not servers or not all(usable(s) for s in servers):
        msg = (
            f"OUTBOX_KAFKA_BOOTSTRAP_SERVERS {value!r}: expected host:port[,host:port...] "
            "with ports 1-65535"
        )
        raise ValueError(msg)
    return ",".join(servers)


def relations(s: Choices) -> None:
    if s.backoff_max_seconds < s.backoff_initial_seconds:
        msg = "OUTBOX_BACKOFF_MAX_SECONDS must be >= OUTBOX_BACKOFF_INITIAL_SECONDS"
        raise ValueError(msg)
    if s.delivery == "exactly-once" and s.transaction_timeout_seconds >= s.lease_seconds:
        msg = (
            "OUTBOX_TRANSACTION_TIMEOUT_SECONDS must be < OUTBOX_LEASE_SECONDS: a batch's "
            "transaction has to end before its lease"
        )
        raise ValueError(msg)
    if s.delivery == "exactly-once" and s.synchronous_commit == "off":
        msg = (
            "OUTBOX_SYNCHRONOUS_COMMIT=off cannot be used with OUTBOX_DELIVERY=exactly-once: a "
            "mark a database crash loses would send its batch again (a second copy to "
            "read_committed consumers); unset it (exactly-once then runs with on)"
        )
        raise ValueError(msg)
    if s.delivery == "exactly-once":
        progress_record_fits(s)
    if s.kafka_sasl_mechanism and not (s.kafka_sasl_username and s.kafka_sasl_password):
        msg = "OUTBOX_KAFKA_SASL_MECHANISM needs OUTBOX_KAFKA_SASL_USERNAME and _PASSWORD"
        raise ValueError(msg)


def progress_record_fits(s: Choices) -> None:
    """Exactly-once (review E8): a transaction ends with a progress record listing its batch's
    rows; one that cannot fit a request would abort every transaction of the lane."""
    names = len(s.transactional_id_prefix) + 2 * (len(s.db_schema) + len(s.table) + 60)
    needed = progress_record_bytes_at_most(s.batch_size, names)
    if needed > s.kafka_max_request_bytes:
        msg = (
            f"OUTBOX_BATCH_SIZE={s.batch_size} needs progress records of up to {needed} bytes "
            "in exactly-once delivery (each lists its batch's rows, "
            f"{PROGRESS_PAIR_BYTES_AT_MOST} bytes a row at most, and "
            f"{PROGRESS_RECORD_OVERHEAD_BYTES} more), more than "
            f"OUTBOX_KAFKA_MAX_REQUEST_BYTES={s.kafka_max_request_bytes}: lower "
            "OUTBOX_BATCH_SIZE or raise OUTBOX_KAFKA_MAX_REQUEST_BYTES (and the broker's "
            "message.max.bytes)"
        )
        raise ValueError(msg)


def kafka_security(s: Choices) -> None:
    """Credentials or TLS files that the chosen protocol would silently not use are a
    mistake that sends data in the clear: refuse them."""
    protocol = s.kafka_security_protocol
    sasl = protocol.startswith("SASL_")
    if sasl and not s.kafka_sasl_mechanism:
        msg = f"OUTBOX_KAFKA_SECURITY_PROTOCOL={protocol} needs OUTBOX_KAFKA_SASL_MECHANISM"
        raise ValueError(msg)
    sasl_given = [
        name
        for name, value in (
            ("OUTBOX_KAFKA_SASL_MECHANISM", s.kafka_sasl_mechanism),
            ("OUTBOX_KAFKA_SASL_USERNAME", s.kafka_sasl_username),
            ("OUTBOX_KAFKA_SASL_PASSWORD", s.kafka_sasl_password),
        )
        if value
    ]
    if not sasl and sasl_given:
        msg = (
            f"{', '.join(sasl_given)} set but OUTBOX_KAFKA_SECURITY_PROTOCOL={protocol} "
            "does not use SASL (the credentials would go unused and the data in the clear): "
            "set SASL_SSL (or SASL_PLAINTEXT) and OUTBOX_KAFKA_SASL_MECHANISM"
        )
        raise ValueError(msg)
    tls_files = {
        "OUTBOX_KAFKA_SSL_CAFILE": s.kafka_ssl_cafile,
        "OUTBOX_KAFKA_SSL_CERTFILE": s.kafka_ssl_certfile,
        "OUTBOX_KAFKA_SSL_KEYFILE": s.kafka_ssl_keyfile,
        "OUTBOX_KAFKA_SSL_KEY_PASSWORD": s.kafka_ssl_key_password,
    }
    given = [name for name, value in tls_files.items() if value]
    if given and protocol not in ("SSL", "SASL_SSL"):
        msg = (
            f"{', '.join(given)} set but OUTBOX_KAFKA_SECURITY_PROTOCOL={protocol} does not "
            "use TLS: set SSL or SASL_SSL"
        )
        raise ValueError(msg)
    if (s.kafka_ssl_keyfile or s.kafka_ssl_key_password) and not s.kafka_ssl_certfile:
        msg = "OUTBOX_KAFKA_SSL_KEYFILE and _KEY_PASSWORD need OUTBOX_KAFKA_SSL_CERTFILE"
        raise ValueError(msg)


def topic_setting(value: str | None, *, template: bool) -> str | None:
    """OUTBOX_DEFAULT_TOPIC must be a topic name; OUTBOX_TOPIC_TEMPLATE a template of one."""
    if value is None:
        return None
    if template:
        return routing.check_template(value)
    if not routing.valid_topic(value):
        msg = f"OUTBOX_DEFAULT_TOPIC {value!r} is not a valid Kafka topic name"
        raise ValueError(msg)
    return value
