"""The TLS context for the producer, and one diagnosis connection that turns a refused login or
certificate into one clear configuration error (the producer itself reports only "Unable to
bootstrap", which reads like an outage)."""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass

from aiokafka import errors as kafka_errors
from pydantic import SecretStr

from outbox_dispatcher import errors
from outbox_dispatcher.kafka import internals


@dataclass(frozen=True)
class ConnectionConfig:
    """How the producer reaches and logs in to the brokers (the OUTBOX_KAFKA_* settings the
    messages below name)."""

    bootstrap_servers: str
    client_id: str
    security_protocol: str
    sasl_mechanism: str | None
    sasl_username: str | None
    sasl_password: SecretStr | None
    ssl_cafile: str | None
    ssl_certfile: str | None
    ssl_keyfile: str | None
    ssl_key_password: SecretStr | None
    ssl_check_hostname: bool
    # A request's timeout (OUTBOX_PUBLISH_TIMEOUT_SECONDS); the diagnosis waits at most 10 s.
    request_timeout_seconds: float


SASL_REJECTED = (
    "Kafka rejected the SASL credentials ({}): check OUTBOX_KAFKA_SASL_USERNAME, "
    "OUTBOX_KAFKA_SASL_PASSWORD and OUTBOX_KAFKA_SASL_MECHANISM"
)


def ssl_context(config: ConnectionConfig) -> ssl.SSLContext | None:
    """The TLS context for SSL and SASL_SSL: the broker verified against ssl_cafile (the
    system CAs without it), a client certificate when one is configured."""
    s = config
    if s.security_protocol not in ("SSL", "SASL_SSL"):
        return None
    try:
        context = ssl.create_default_context(cafile=s.ssl_cafile)
    except (OSError, ssl.SSLError) as exc:
        msg = (
            f"cannot load the CA file OUTBOX_KAFKA_SSL_CAFILE={s.ssl_cafile!r} "
            f"({errors.describe(exc)}): give a readable PEM bundle"
        )
        raise errors.ConfigurationError(msg) from exc
    context.check_hostname = s.ssl_check_hostname
    if s.ssl_certfile:
        key_password = s.ssl_key_password
        try:
            # Never let OpenSSL prompt on a terminal for a missing key password.
            context.load_cert_chain(
                s.ssl_certfile,
                s.ssl_keyfile,
                password=key_password.get_secret_value() if key_password else _no_password,
            )
        except (OSError, ssl.SSLError) as exc:
            msg = (
                f"cannot load the client certificate OUTBOX_KAFKA_SSL_CERTFILE="
                f"{s.ssl_certfile!r} with OUTBOX_KAFKA_SSL_KEYFILE={s.ssl_keyfile!r} "
                f"({errors.describe(exc)}): check both files and OUTBOX_KAFKA_SSL_KEY_PASSWORD"
            )
            raise errors.ConfigurationError(msg) from exc
    return context


def _no_password() -> bytes:
    return b""


async def diagnose(
    config: ConnectionConfig, context: ssl.SSLContext | None
) -> errors.ConfigurationError | None:
    """Connect once to the first bootstrap server the way the producer will, and turn a refused
    login or certificate into one clear configuration error. The producer itself would only
    report "Unable to bootstrap", which reads like an outage. Anything else (the broker is down)
    is left to the producer's own start."""
    s = config
    host, _, port = s.bootstrap_servers.split(",")[0].rpartition(":")
    password = s.sasl_password.get_secret_value() if s.sasl_password else None
    try:
        async with asyncio.timeout(min(10.0, s.request_timeout_seconds)):
            conn = await internals.open_connection(
                host,
                int(port),
                client_id=s.client_id,
                request_timeout_ms=int(s.request_timeout_seconds * 1000),
                ssl_context=context,
                security_protocol=s.security_protocol,
                sasl_mechanism=s.sasl_mechanism or "PLAIN",
                sasl_plain_username=s.sasl_username,
                sasl_plain_password=password,
            )
    except (kafka_errors.SaslAuthenticationFailed, kafka_errors.AuthenticationFailedError) as exc:
        return errors.ConfigurationError(SASL_REJECTED.format(errors.describe(exc)))
    except kafka_errors.UnsupportedSaslMechanismError as exc:
        return errors.ConfigurationError(
            f"the broker does not accept OUTBOX_KAFKA_SASL_MECHANISM={s.sasl_mechanism} "
            f"({errors.describe(exc)}): use one it enables"
        )
    except ssl.SSLCertVerificationError as exc:
        return errors.ConfigurationError(_certificate_rejected(exc))
    except ssl.SSLError as exc:
        return errors.ConfigurationError(_tls_failed(s, exc))
    except (kafka_errors.KafkaError, OSError, TimeoutError, ValueError):
        if context is not None:
            return await _diagnose_tls(s, host, int(port), context)
        return None
    conn.close()
    return None


async def _diagnose_tls(
    config: ConnectionConfig, host: str, port: int, context: ssl.SSLContext
) -> errors.ConfigurationError | None:
    """What aiokafka reports as a closed connection. With TLS 1.3 a broker that refuses the
    client's certificate (or its absence) lets the handshake finish and sends its alert after
    the client's first bytes; a listener that does not speak TLS drops the handshake."""
    writer: asyncio.StreamWriter | None = None
    handshake_done = False
    try:
        async with asyncio.timeout(5.0):
            reader, writer = await asyncio.open_connection(host, port, ssl=context)
            handshake_done = True
            writer.write(b"\x00\x00\x00\x00")  # an empty Kafka request: the broker closes
            await writer.drain()
            await reader.read(1)
    except ssl.SSLCertVerificationError as exc:
        return errors.ConfigurationError(_certificate_rejected(exc))
    except ssl.SSLError as exc:
        return errors.ConfigurationError(_tls_failed(config, exc))
    except ConnectionResetError as exc:
        if handshake_done:
            return None
        return errors.ConfigurationError(
            f"{host}:{port} dropped the TLS handshake ({errors.describe(exc)}): it is probably "
            "not a TLS listener; check OUTBOX_KAFKA_SECURITY_PROTOCOL and the port in "
            "OUTBOX_KAFKA_BOOTSTRAP_SERVERS"
        )
    except (OSError, TimeoutError):
        return None
    finally:
        if writer is not None:
            writer.close()
    return None


def _certificate_rejected(exc: ssl.SSLCertVerificationError) -> str:
    return (
        f"the Kafka broker's TLS certificate was not accepted ({exc.verify_message or exc}): "
        "OUTBOX_KAFKA_SSL_CAFILE must name the CA that signed it, and the certificate must name "
        "the host in OUTBOX_KAFKA_BOOTSTRAP_SERVERS (or set OUTBOX_KAFKA_SSL_CHECK_HOSTNAME=false)"
    )


def _tls_failed(config: ConnectionConfig, exc: ssl.SSLError) -> str:
    alert = str(exc).upper()
    if "CERTIFICATE" in alert and not config.ssl_certfile:
        hint = (
            "the broker wants a client certificate: set OUTBOX_KAFKA_SSL_CERTFILE and "
            "OUTBOX_KAFKA_SSL_KEYFILE"
        )
    elif "CERTIFICATE" in alert:
        hint = (
            "the broker refused the client certificate OUTBOX_KAFKA_SSL_CERTFILE: it must be "
            "signed by a CA the broker trusts"
        )
    else:
        hint = "check OUTBOX_KAFKA_SECURITY_PROTOCOL and the OUTBOX_KAFKA_SSL_* settings"
    return f"the TLS handshake with Kafka failed ({errors.describe(exc)}): {hint}"
