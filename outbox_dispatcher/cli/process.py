"""The commands that are a process of their own or set one up: `run` (the dispatcher, until a
signal), `migrate` and `console` (the operator console, until a signal)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

import structlog

from outbox_dispatcher import display, errors, tracing
from outbox_dispatcher.cli.flags import (
    BATCHED,
    CONNECT,
    EVERY,
    Commands,
    command,
    source_flag,
    switch,
)
from outbox_dispatcher.cli.terminal import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, err, out
from outbox_dispatcher.config.outboxes import sources_given, sources_of
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.fleet import FleetDispatcher
from outbox_dispatcher.dispatch.supervisor import Dispatcher
from outbox_dispatcher.operate import schema, sources
from outbox_dispatcher.operate.check import unknown_variables
from outbox_dispatcher.operate.session import connected

log = structlog.get_logger(__name__)

# What `console` needs beyond the dispatcher: the install extra outbox-dispatcher[console].
WEB_STACK = frozenset({"starlette", "jinja2", "markupsafe", "uvicorn", "itsdangerous"})
WEB_STACK |= {"python_multipart", "multipart"}  # python-multipart, by its new and its old name
NO_WEB_STACK = (
    "`outbox-dispatcher console` needs the console's web stack (missing: {missing}): "
    "install it with pip install 'outbox-dispatcher[console]'"
)


def configure_run_parser(commands: Commands) -> None:
    command(commands, "run", _run, EVERY)


async def _run(settings: Settings, _: argparse.Namespace) -> int:
    """dispatch until SIGTERM/SIGINT

    Dispatch until SIGTERM/SIGINT."""
    if settings.tracing:
        try:
            tracing.configure_sdk()
        except ImportError as missing:
            msg = "OUTBOX_TRACING needs OpenTelemetry: install outbox-dispatcher[otel]"
            raise errors.ConfigurationError(msg) from missing
    for variable, close in unknown_variables(os.environ):
        # What `check` fails on: the setting meant is not in effect.
        log.warning("unknown_setting_variable", variable=variable, did_you_mean=close)
    dispatcher: Dispatcher | FleetDispatcher = (
        Dispatcher(settings)
        if settings.sources is None
        else FleetDispatcher(settings, sources_of(settings))
    )
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()

    def on_signal(signum: signal.Signals) -> None:
        if dispatcher.stopping.is_set():
            log.warning("second_signal_cancelling", signal=signum.name)
            if main_task is not None:
                main_task.cancel()
        else:
            log.info("signal_received", signal=signum.name)
            dispatcher.stop()

    signals = (signal.SIGTERM, signal.SIGINT)
    for signum in signals:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        return await _dispatch(dispatcher)
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


async def _dispatch(dispatcher: Dispatcher | FleetDispatcher) -> int:
    code = EXIT_OK
    try:
        await dispatcher.run()
    except* errors.ConfigurationError as config_errors:
        for exc in config_errors.exceptions:
            log.error("configuration_error", error=str(exc))
        code = EXIT_CONFIG
    except* errors.OutboxDispatcherError as failures:
        for failure in failures.exceptions:
            log.error("failed", error=str(failure), error_type=type(failure).__name__)
        code = EXIT_FAILED
    except* Exception as crashes:
        # A dead loop stopped the TaskGroup: exit non-zero so that the process is restarted.
        for crash in crashes.exceptions:
            log.error("loop_died", error=errors.describe(crash), exc_info=crash)
        code = EXIT_FAILED
    return code


def configure_migrate_parser(commands: Commands) -> None:
    parser = command(commands, "migrate", _migrate, CONNECT)
    switch(
        parser,
        "--contract-now",
        "apply such a step even while older dispatchers run (they stop with a message)",
    )


async def _migrate(settings: Settings, ns: argparse.Namespace) -> int:
    """create or upgrade the outbox schema (idempotent)

    Create or upgrade the outbox schema; safe to run concurrently. A step that dispatchers of
    an older version cannot run beside waits until none of them runs (run migrate again after
    the rollout). With OUTBOX_SOURCES, every schema of every source (each pattern's matching
    schemas), or only --schema NAME's, each on its own: the exit code says whether any failed;
    and the fleet's membership table in OUTBOX_DATABASE_URL's database."""
    if settings.sources is not None or sources_given():
        return await _migrate_sources(settings, ns)
    done = await schema.migrate(settings, contract=ns.contract_now)
    applied, version = done.applied, done.version
    log.info("schema_ready", version=version, applied=applied)
    where = f"{settings.db_schema}.{settings.table}"
    what = f"applied {', '.join(map(str, applied))}" if applied else "nothing to apply"
    sys.stdout.write(f"schema {where} is at version {version} ({what})\n")
    if done.waiting is not None:
        sys.stdout.write(_waits(done.waiting, done.older))
    return EXIT_OK


def _waits(waiting: int, older: int) -> str:
    return (
        f"version {waiting} waits: {older} dispatcher(s) older than version "
        f"{schema.OLDEST_SUPPORTED} still run beside this schema, and it would stop "
        "them. Run `outbox-dispatcher migrate` again once every dispatcher is upgraded (the "
        "upgraded ones keep working meanwhile), or with --contract-now to apply it anyway\n"
    )


async def _migrate_sources(settings: Settings, ns: argparse.Namespace) -> int:
    """`migrate` of OUTBOX_SOURCES: one line per schema, failures on stderr too."""
    only = settings.db_schema if "db_schema" in settings.model_fields_set else None
    sources = sources_of(settings)
    done = await schema.migrate_sources(
        settings, sources, only_schema=only, contract=ns.contract_now
    )
    for one in done.schemas:
        where = f"schema {one.schema}.{one.table} of {one.database} (source {one.label})"
        if one.error is not None:
            out(f"{where} FAILED: {display.inert(one.error)}")
            continue
        what = f"applied {', '.join(map(str, one.applied))}" if one.applied else "nothing to apply"
        out(f"{where} is at version {one.version} ({what})")
        if one.waiting is not None:
            sys.stdout.write(_waits(one.waiting, one.older))
    fleet = "FAILED: " + display.inert(done.fleet) if done.fleet_failed else done.fleet
    out(f"fleet membership table {done.fleet_table} of the home database: {fleet}")
    failed = len(done.failed) + done.fleet_failed
    log.info("sources_migrated", schemas=len(done.schemas), failed=failed)
    if failed:
        err(
            f"{failed} of {len(done.schemas) + 1} migrations failed (see above): fix them and run "
            "`outbox-dispatcher migrate` again (what succeeded stays done)"
        )
        return EXIT_FAILED
    return EXIT_OK


CONSOLE_SETTINGS = (
    *BATCHED,
    "dead_letter_policy",
    "delete_on_publish",
    "console_host",
    "console_port",
    "console_token",
    "console_show_payload",
    "console_payload_max_bytes",
    "console_sample_seconds",
    "console_allowed_hosts",
    "console_anonymous_read",
    "console_trusted_proxies",
    "default_topic",
    "topic_template",
)


def configure_console_parser(commands: Commands) -> None:
    source_flag(command(commands, "console", _console, CONSOLE_SETTINGS), acts=True)


async def _console(settings: Settings, ns: argparse.Namespace) -> int:
    """serve the operator console (pages and a JSON API) until SIGTERM/SIGINT

    Serve the operator console on OUTBOX_CONSOLE_HOST:OUTBOX_CONSOLE_PORT: the backlog, dead
    rows, blocked keys and the audit as pages and under /api/v1/, to people logged in with
    OUTBOX_CONSOLE_TOKEN or named by a trusted proxy (OUTBOX_CONSOLE_TRUSTED_PROXIES), who may
    also requeue, discard, replay, pause and resume; with OUTBOX_CONSOLE_ANONYMOUS_READ=true
    anyone may read. With OUTBOX_SOURCES, the one outbox --source (and --schema) name is
    served at /, and every other outbox under /outboxes/LABEL/. Needs the install extra
    outbox-dispatcher[console]."""
    # Imported here: the web stack is an install extra, loaded only by the command that serves it.
    try:
        from outbox_dispatcher import console
    except ImportError as missing:
        name = (missing.name or "").partition(".")[0]
        if name not in WEB_STACK:
            raise
        raise errors.ConfigurationError(NO_WEB_STACK.format(missing=name)) from None

    fleet = sources_of(settings) if settings.sources is not None else ()
    settings = await sources.target(settings, ns.source)
    # The schema is checked once before serving, so that a wrong database fails at start.
    async with connected(settings):
        pass
    log.info(
        "console_starting",
        host=settings.console_host,
        port=settings.console_port,
        token=settings.console_token is not None,
        anonymous_read=settings.console_anonymous_read,
        trusted_proxies=settings.console_trusted_proxies,
        show_payload=settings.console_show_payload,
    )
    await console.serve(settings, fleet)
    return EXIT_OK
