"""The Kafka TLS context built from the settings."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.supervisor import configs_of
from outbox_dispatcher.kafka.tls import ssl_context


def context_for(settings: Settings) -> ssl.SSLContext | None:
    return ssl_context(configs_of(settings).publisher.producer.connection)


@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SASL_PLAINTEXT"])
def test_no_context_without_tls(protocol: str) -> None:
    extra = (
        {"kafka_sasl_mechanism": "PLAIN", "kafka_sasl_username": "u"} if "SASL" in protocol else {}
    )
    if extra:
        extra["kafka_sasl_password"] = "p"
    assert context_for(Settings(kafka_security_protocol=protocol, **extra)) is None


@pytest.mark.parametrize("check_hostname", [True, False])
def test_the_broker_is_always_verified_and_the_host_name_as_configured(
    check_hostname: bool,
) -> None:
    context = context_for(
        Settings(kafka_security_protocol="SSL", kafka_ssl_check_hostname=check_hostname)
    )
    assert context is not None
    assert context.verify_mode is ssl.CERT_REQUIRED
    assert context.check_hostname is check_hostname


def test_unreadable_files_are_configuration_errors(tmp_path: Path) -> None:
    missing = tmp_path / "ca.crt"
    with pytest.raises(errors.ConfigurationError, match="OUTBOX_KAFKA_SSL_CAFILE"):
        context_for(Settings(kafka_security_protocol="SSL", kafka_ssl_cafile=str(missing)))
    with pytest.raises(errors.ConfigurationError, match="OUTBOX_KAFKA_SSL_CERTFILE"):
        context_for(
            Settings(
                kafka_security_protocol="SSL",
                kafka_ssl_certfile=str(tmp_path / "c.crt"),
                kafka_ssl_key_password="k3y-pa55",
            )
        )
