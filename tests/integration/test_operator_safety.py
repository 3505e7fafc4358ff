"""The operator's side at 3 a.m.: inert output, no secret fragments, commands that cannot leave a
mess, status that tells the truth. Each command runs as a real `python -m outbox_dispatcher`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import signal
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.store import migrations

from .helpers import Services, cli, interruptible, running, settings_env, wait_until
from .test_observability import port_of, scrape
from .test_security import _as_role, _roles_database

pytestmark = pytest.mark.integration

CLEAR_SCREEN = "evil\x1b[2J\x1b[H\x1b[31mPWNED\x1b[0m"
FORGED_ROW = "line1\nid  event_id  topic  key\n999  fake-row  orders  admin"
HOSTILE_KEYS = [
    CLEAR_SCREEN,
    "title\x1b]0;owned-title\x07x",
    FORGED_ROW,
    "cr\rOVERWRITE",
    "bidi\u202egnp.exe",
]


def _settings(make_settings: Any, **overrides: Any) -> Settings:
    settings: Settings = make_settings(**overrides)
    return settings


def _raw_controls(text: str) -> set[str]:
    return {c for c in text if c != "\n" and not c.isprintable()}


async def _dead_rows(conn: asyncpg.Connection, keys: list[str], topic: str) -> None:
    await conn.executemany(
        "INSERT INTO outbox (topic, ordering_key, payload, dead_at, last_error)"
        " VALUES ($1, $2, 'x', now(), $3)",
        [(topic, key, "no route: " + key) for key in keys],
    )


async def test_dead_list_prints_hostile_keys_inert_and_json_exact(
    conn: asyncpg.Connection, make_settings: Any, topic: str
) -> None:
    await _dead_rows(conn, HOSTILE_KEYS, topic)
    settings = _settings(make_settings)
    listed = await cli(settings, "dead", "list")
    assert listed.code == 0, listed.err
    assert not _raw_controls(listed.out)
    lines = listed.out.splitlines()
    assert len(lines) == 1 + len(HOSTILE_KEYS)  # no forged row
    assert not any(line.startswith("999") for line in lines)
    assert "evil\\x1b[2J\\x1b[H\\x1b[31mPWNED" in listed.out
    exact = await cli(settings, "dead", "list", "--json")
    assert sorted(r["ordering_key"] for r in orjson.loads(exact.out)) == sorted(HOSTILE_KEYS)


async def test_status_prints_a_hostile_pause_note_inert(
    conn: asyncpg.Connection, make_settings: Any, topic: str
) -> None:
    settings = _settings(make_settings)
    reason = "smtp down\x1b[2J\x1b[H\x1b[32mALL GOOD\x1b[0m\nfake: line"
    paused = await cli(
        settings, "pause", "--topic", topic, "--reason", reason, env={"LOGNAME": "ceo\x1b[31m"}
    )
    assert paused.code == 0, paused.err
    shown = await cli(settings, "status")
    assert shown.code == 0, shown.err
    assert not _raw_controls(shown.out)
    assert "fake: line" not in shown.out.splitlines()
    assert "ALL GOOD" in shown.out  # escaped, not hidden
    exact = orjson.loads((await cli(settings, "status", "--json")).out)
    assert exact["pauses"][0]["reason"] == reason


# --- Commands that cannot leave a mess ----------------------------------------------------------


async def _published_rows(conn: asyncpg.Connection, topic: str, n: int, keys: int = 50) -> None:
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, published_at)"
        " SELECT $1, 'k-' || (g % $3), 'x', now() FROM generate_series(1, $2) g",
        topic,
        n,
        keys,
    )


def _signal_dispositions(pid: int) -> str:
    """The process's blocked, ignored and caught signal masks (for a failure message)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text(encoding="ascii").splitlines()
    except OSError as exc:
        return f"unknown ({exc})"
    return " ".join(line for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


async def _wait_for_lock_wait(conn: asyncpg.Connection) -> None:
    for _ in range(600):
        waiting = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = 'outbox-dispatcher' AND wait_event_type = 'Lock'"
        )
        if waiting:
            return
        await asyncio.sleep(0.1)
    msg = "the replay never reached its audit row"
    raise AssertionError(msg)


async def test_an_interrupted_replay_changes_nothing_and_says_so_in_one_line(
    conn: asyncpg.Connection, make_settings: Any, database_url: str, topic: str
) -> None:
    await _published_rows(conn, topic, 5000)
    settings = _settings(make_settings, cleanup_batch_size=100)
    # Hold the audit table: the replay does all its batches, then waits on its last statement,
    # inside its one transaction; Ctrl-C arrives there.
    blocker = await asyncpg.connect(database_url)
    try:
        lock = blocker.transaction()
        await lock.start()
        await blocker.execute("LOCK TABLE outbox_operator_audit IN ACCESS EXCLUSIVE MODE")
        process = await interruptible(settings, "replay", "--topic", topic)
        await _wait_for_lock_wait(conn)
        dispositions = _signal_dispositions(process.pid)
        process.send_signal(signal.SIGINT)
        try:
            out, err = await asyncio.wait_for(process.communicate(), 60)
        except TimeoutError:
            process.kill()
            out, err = await process.communicate()
            msg = (
                f"the replay did not exit within 60 s of SIGINT; its signal masks {dispositions}; "
                f"stderr: {err.decode()[-2000:]}"
            )
            raise AssertionError(msg) from None
        await lock.rollback()
    finally:
        await blocker.close()
    assert process.returncode == 130
    assert err.decode().strip().splitlines() == [
        "outbox-dispatcher: interrupted: nothing was replayed (a replay is one transaction)"
    ]
    assert "Traceback" not in out.decode() + err.decode()
    assert await conn.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0
    assert await conn.fetchval("SELECT count(*) FROM outbox_operator_audit") == 0
    # Run again: the whole replay, at once, recorded.
    again = await cli(settings, "replay", "--topic", topic)
    assert again.code == 0, again.err
    assert "replayed 5000 published rows" in again.out
    assert await conn.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 5000
    assert await conn.fetchval("SELECT count(*) FROM outbox WHERE next_attempt_at > now()") == 0


async def test_release_held_lets_go_what_an_old_interrupted_replay_held(
    conn: asyncpg.Connection, make_settings: Any, topic: str
) -> None:
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, next_attempt_at, last_error)"
        " SELECT $1, 'k-' || (g % 5), 'x', now() + interval '10 minutes',"
        "        'replayed by operator at 2026-11-30 (published before at 2026-11-29)'"
        "   FROM generate_series(1, 20) g",
        topic,
    )
    # A row in backoff after a failure is not a held replay row: left alone.
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, attempts, next_attempt_at, last_error)"
        " VALUES ($1, 'other', 'x', 2, now() + interval '10 minutes', 'broker said no')",
        topic,
    )
    settings = _settings(make_settings, metrics_interval_seconds=0.2)
    shown = orjson.loads((await cli(settings, "status", "--json")).out)
    assert shown["totals"]["held_keys"] == 5
    async with running(settings) as dispatcher:
        port = await port_of(dispatcher)
        held = ("outbox_blocked_keys", (("reason", "held"),))
        backoff = ("outbox_blocked_keys", (("reason", "backoff"),))

        async def metrics_show_them() -> bool:
            samples = await scrape(port)
            return samples.get(held) == 5 and samples.get(backoff) == 1

        await wait_until(metrics_show_them, 30, "the held keys in /metrics")
        released = await cli(settings, "replay", "--release-held")
        assert released.code == 0, released.err
        assert released.out.strip() == "released 20 held rows"
        await wait_until(
            lambda: conn.fetchval(
                "SELECT count(*) = 20 FROM outbox WHERE published_at IS NOT NULL"
            ),
            60,
            "the released rows to be published",
        )
    assert await conn.fetchval("SELECT count(*) FROM outbox WHERE next_attempt_at > now()") == 1
    row = await conn.fetchrow("SELECT command, rows FROM outbox_operator_audit")
    assert (row["command"], row["rows"]) == ("replay --release-held", 20)


def _tty_answering(answer: str) -> int:
    """A terminal as stdin, with `answer` typed into it; returns the fd for the child."""
    controller, terminal = pty.openpty()
    os.write(controller, answer.encode() + b"\n")
    return terminal


async def _cli_on_terminal(settings: Settings, answer: str, *args: str) -> tuple[int, str, str]:
    terminal = _tty_answering(answer)
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "outbox_dispatcher",
            *args,
            env=settings_env(settings),
            stdin=terminal,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 60)
    finally:
        os.close(terminal)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_the_widest_commands_have_a_dry_run_and_ask_on_a_terminal(
    conn: asyncpg.Connection, make_settings: Any, topic: str
) -> None:
    await _dead_rows(conn, ["a", "b", "c"], topic)
    await _published_rows(conn, topic, 7, keys=2)
    settings = _settings(make_settings)
    dead = "SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL"
    published = "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL"

    dry = await cli(settings, "dead", "discard", "--all", "--dry-run")
    assert (dry.code, dry.out.strip()) == (0, "would discard 3 dead rows")
    dry = await cli(settings, "replay", "--all", "--dry-run")
    assert (dry.code, dry.out.strip()) == (0, "would replay 7 published rows")
    dry = await cli(settings, "cleanup", "--older-than", "0", "--dry-run")
    assert (dry.code, dry.out.strip()) == (0, "would delete 7 published rows older than 0s")
    dry = await cli(settings, "pause", "--dry-run")
    assert dry.out.startswith("would pause the whole table")
    assert (await conn.fetchval(dead), await conn.fetchval(published)) == (3, 7)

    for args in (
        ("dead", "discard", "--all"),
        ("replay", "--all"),
        ("cleanup", "--older-than", "0"),
        ("pause",),
    ):
        code, _, err = await _cli_on_terminal(settings, "no", *args)
        assert code == 1, err
        assert "Type 'yes' to go on" in err and "not confirmed: nothing changed" in err
    assert (await conn.fetchval(dead), await conn.fetchval(published)) == (3, 7)
    assert await conn.fetchval("SELECT count(*) FROM outbox_paused") == 0
    assert await conn.fetchval("SELECT count(*) FROM outbox_operator_audit") == 0

    code, out, err = await _cli_on_terminal(settings, "yes", "dead", "discard", "--all")
    assert (code, out.strip()) == (0, "discarded 3 dead rows"), err
    yes = await cli(settings, "cleanup", "--older-than", "0", "--yes")
    assert (yes.code, yes.out.strip()) == (0, "deleted 7 published rows older than 0s")


async def test_every_operator_action_is_audited_by_database_role_not_environment(
    conn: asyncpg.Connection, make_settings: Any, topic: str
) -> None:
    await _dead_rows(conn, ["a", "b"], topic)
    await _published_rows(conn, topic, 3, keys=1)
    settings = _settings(make_settings)
    spoof = {"LOGNAME": "ceo", "USER": "ceo"}
    steps = [
        ("dead", "requeue", "--key", "a"),
        ("dead", "discard", "--key", "b"),
        ("replay", "--topic", topic),
        ("pause", "--topic", topic, "--reason", "smtp down"),
        ("resume", "--topic", topic),
        ("cleanup", "--older-than", "3600"),
    ]
    for args in steps:
        ran = await cli(settings, *args, env=spoof)
        assert ran.code == 0, ran.err
    rows = await conn.fetch("SELECT * FROM outbox_operator_audit ORDER BY id")
    assert [(r["command"], r["rows"]) for r in rows] == [
        ("dead requeue", 1),
        ("dead discard", 1),
        ("replay", 3),
        ("pause", 1),
        ("resume", 1),
        ("cleanup", 0),
    ]
    assert orjson.loads(rows[0]["filter"]) == {"key": "a"}
    assert orjson.loads(rows[2]["filter"]) == {"topic": topic}
    role = await conn.fetchval("SELECT session_user")
    assert {(r["db_role"], r["session_role"]) for r in rows} == {(role, role)}
    assert {str(r["client_addr"]) for r in rows} == {"127.0.0.1"}
    # paused_by: the database role and address, whatever $LOGNAME says.
    await cli(settings, "pause", "--topic", topic, env=spoof)
    assert await conn.fetchval("SELECT paused_by FROM outbox_paused") == f"{role}@127.0.0.1"
    assert not await conn.fetchval("SELECT bool_or(paused_by LIKE '%ceo%') FROM outbox_paused")


async def test_a_command_without_the_privilege_names_the_role_it_needs(
    services: Services, make_settings: Any
) -> None:
    async with _roles_database(services) as (url, owner, dispatcher):
        sql = migrations.render_roles("public", "outbox", owner, dispatcher)
        admin = await asyncpg.connect(url)
        try:
            await admin.execute(sql)
            for role in (owner, dispatcher):
                await admin.execute(f"ALTER ROLE \"{role}\" LOGIN PASSWORD 'pw-{role}'")
            owner_conn = await asyncpg.connect(_as_role(url, owner, f"pw-{owner}"))
            try:
                await migrations.migrate(owner_conn, "public", "outbox")
            finally:
                await owner_conn.close()
            await admin.execute(sql)
            settings = _settings(
                make_settings, database_url=_as_role(url, dispatcher, f"pw-{dispatcher}")
            )
            ran = await cli(settings, "pause", "--topic", "orders", "--yes")
            assert ran.code == 1
            lines = ran.err.strip().splitlines()
            assert len(lines) == 1, ran.err
            assert f"database role '{dispatcher}'" in lines[0]
            assert "the owner role of schema/roles.sql" in lines[0]
            # The dispatcher role may run the others (and they are audited).
            assert (await cli(settings, "dead", "requeue", "--all")).code == 0
        finally:
            await admin.close()


# --- Status that tells the truth ----------------------------------------------------------------


async def test_status_counts_blocked_keys_under_the_running_dispatchers_policy_and_sees_them(
    conn: asyncpg.Connection, make_settings: Any, topic: str
) -> None:
    operator = _settings(make_settings)  # the operator's own environment: policy skip
    assert operator.dead_letter_policy.value == "skip"
    await _dead_rows(conn, ["k"], topic)
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, 'k', 'x')", topic
    )

    alone = await cli(operator, "status")
    assert "dispatchers: none alive" in alone.out
    assert json_status(await cli(operator, "status", "--json"))["dispatchers"] == []

    async with running(_settings(make_settings, dead_letter_policy="block")):
        await wait_until(
            lambda: conn.fetchval("SELECT count(*) = 1 FROM outbox_dispatchers"),
            timeout=30,
            what="the dispatcher's heartbeat",
        )
        shown = await cli(operator, "status")
        report = json_status(await cli(operator, "status", "--json"))
    assert shown.code == 0, shown.err
    assert "dispatchers: 1 alive" in shown.out and "dead-letter policy block" in shown.out
    header, row = shown.out.splitlines()[:2]
    assert header.split()[:3] == ["topic", "waiting", "in_flight"]
    assert row.split()[0] == topic and "1 (1 dead)" in row
    assert report["dead_letter_policy"] == "block"
    assert report["totals"]["dead_blocked_keys"] == 1
    assert (
        report["totals"]["pending"] == report["totals"]["waiting"] + report["totals"]["in_flight"]
    )
    assert [d["dead_letter_policy"] for d in report["dispatchers"]] == ["block"]


def json_status(ran: Any) -> dict[str, Any]:
    assert ran.code == 0, ran.err
    report: dict[str, Any] = orjson.loads(ran.out)
    return report


# --- Messages -----------------------------------------------------------------------------------


async def test_check_warns_about_unknown_variables_and_missing_topics_of_dead_rows(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    gone = f"gone-{uuid.uuid4().hex[:10]}"
    await _dead_rows(conn, ["a"], gone)
    misspelt = {"OUTBOX_DEADLETTER_POLICY": "block", "OUTBOX_KAFKA_BOOTSTRAP_SERVER": "x:1"}
    ran = await cli(_settings(make_settings), "check", env=misspelt)
    # A misspelt variable fails the check: the setting meant is not in effect (notes do not).
    assert ran.code == 1, ran.err
    assert (
        "problem: OUTBOX_DEADLETTER_POLICY is not a setting and is ignored: did you mean "
        "OUTBOX_DEAD_LETTER_POLICY?" in ran.err
    )
    assert "did you mean OUTBOX_KAFKA_BOOTSTRAP_SERVERS?" in ran.err
    assert f"note: topic '{gone}' of dead rows does not exist" in ran.out


async def test_operator_errors_and_empty_results_are_one_plain_line_with_a_hint(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    settings = _settings(make_settings)
    typo = await cli(settings, "status", "--table", "nosuch")
    assert typo.code == 1
    assert typo.err.strip().splitlines() == [
        "outbox-dispatcher: there is no outbox table public.nosuch in this database: check "
        "OUTBOX_SCHEMA, OUTBOX_TABLE and the database in OUTBOX_DATABASE_URL; for a new outbox, "
        "run `outbox-dispatcher migrate` (or apply schema/migrations with your migration tool)"
    ]
    nothing = await cli(settings, "dead", "discard", "--id", "99999")
    assert (nothing.code, nothing.out.strip()) == (
        0,
        "no dead row matches: nothing changed (`outbox-dispatcher dead list` shows the dead rows)",
    )
    backwards = await cli(settings, "replay", "--from-id", "10", "--to-id", "1")
    assert backwards.code == 2
    assert "--from-id 10 is after --to-id 1" in backwards.err
    unfiltered = await cli(settings, "replay")
    assert "give --from-id, --to-id, --key, --topic, --since, --until, or --all" in unfiltered.err
    unfiltered = await cli(settings, "dead", "requeue")
    flags = "--id, --key, --keyless, --topic, --since, --until, --dead-since, --dead-until, --error"
    assert f"give {flags}, or --all" in unfiltered.err
    assert "replay also" not in unfiltered.err
    never = await cli(settings, "resume", "--topic", "never-paused")
    assert never.out.strip() == "topic never-paused was not paused: nothing changed"


async def test_dead_rows_are_selected_by_routed_topic_keyless_and_time_of_death(
    conn: asyncpg.Connection, make_settings: Any, topic: str
) -> None:
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, dead_at, last_error) VALUES"
        " (NULL, 'routed-key', 'x', now(), 'no route'),"
        " ($1, NULL, 'x', now(), 'keyless'),"
        " ($1, '-', 'x', now() - interval '2 hours', 'old death')",
        topic,
    )
    settings = _settings(make_settings)

    async def keys(*args: str) -> list[str | None]:
        ran = await cli(settings, "dead", "list", "--json", *args)
        assert ran.code == 0, ran.err
        return [row["ordering_key"] for row in orjson.loads(ran.out)]

    assert await keys("--topic", "(routed)") == ["routed-key"]
    assert await keys("--keyless") == [None]
    assert await keys("--key", "-") == ["-"]  # a real key "-" is not the missing key
    hour_ago = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    assert await keys("--dead-until", hour_ago) == ["-"]
    assert sorted(await keys("--dead-since", hour_ago), key=str) == [None, "routed-key"]
    table = (await cli(settings, "dead", "list")).out
    assert "(routed)" in table and "(none)" in table and "created_at" in table
    discarded = await cli(settings, "dead", "discard", "--topic", "(routed)")
    assert discarded.out.strip() == "discarded 1 dead row"


async def test_an_operator_command_at_a_terminal_logs_for_a_person_not_json(
    conn: asyncpg.Connection, make_settings: Any, topic: str
) -> None:
    controller, terminal = pty.openpty()
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "outbox_dispatcher",
            "pause",
            "--topic",
            topic,
            env=settings_env(_settings(make_settings, log_format="json")),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=terminal,
        )
        out, _ = await asyncio.wait_for(process.communicate(), 60)
    finally:
        os.close(terminal)
    err = b""
    with contextlib.suppress(OSError):  # EIO once the terminal's other end is closed
        while chunk := os.read(controller, 4096):
            err += chunk
    os.close(controller)
    assert process.returncode == 0
    assert out.decode().startswith(f"paused topic {topic}")
    assert b"paused" in err and b'{"' not in err  # a console line, not a JSON object
