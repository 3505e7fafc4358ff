from __future__ import annotations

import argparse
from datetime import UTC, datetime

import pytest

from outbox_dispatcher import cli
from outbox_dispatcher.cli.flags import FLAGS, filters_of
from outbox_dispatcher.operate.filters import refusal


def parse(*args: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(args))


@pytest.mark.parametrize(
    ("args", "refused"),
    [
        (("dead", "requeue"), "refusing to act without a filter"),
        (("dead", "discard"), "refusing to act without a filter"),
        (("replay",), "refusing to act without a filter"),
        (("dead", "discard", "--all", "--key", "k"), "--all cannot be combined with filters"),
        (("dead", "requeue", "--all"), None),
        (("dead", "requeue", "--id", "3", "--id", "4"), None),
        (("replay", "--from-id", "10"), None),
    ],
)
def test_mass_changes_need_a_filter_or_all(args: tuple[str, ...], refused: str | None) -> None:
    ns = parse(*args)
    problem = refusal(
        filters_of(ns), everything=ns.all, what="act", names=FLAGS, replay=ns.command == "replay"
    )
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(refused)


def test_filters_from_flags() -> None:
    ns = parse("dead", "list", "--id", "1", "--id", "2", "--key", "k", "--since", "2026-01-02")
    f = filters_of(ns)
    assert f.ids == [1, 2] and f.key == "k" and f.topic is None
    assert f.since == datetime(2026, 1, 2, tzinfo=UTC), "a bare time is UTC"
    # The filters, a cause, and no bound (an action's count fixes it).
    given = {"ids": [1, 2], "key": "k", "since": f.since}
    assert {k: v for k, v in f.dead_values().items() if v is not None} == given
    assert set(f.dead_values()) >= {"cause", "max_id", "before"}
    ns = parse("dead", "requeue", "--error", "TooLarge")
    assert filters_of(ns).error == "TooLarge" and not filters_of(ns).empty()
    assert filters_of(ns).dead_values()["error"] == "TooLarge"
    ns = parse("replay", "--topic", "t", "--from-id", "5", "--to-id", "9")
    replay = filters_of(ns).replay_values()
    assert {k: v for k, v in replay.items() if v is not None} == {
        "from_id": 5,
        "to_id": 9,
        "topic": "t",
    }


@pytest.mark.parametrize(
    "args",
    [
        ("dead", "list", "--since", "yesterday"),
        ("dead", "list", "--limit", "0"),
        ("cleanup", "--older-than", "-1"),
        ("pause", "--topic", "not a topic"),
        ("resume", "--topic", "*"),
    ],
)
def test_bad_arguments_exit_2(args: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(*args)
    assert exited.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_every_operator_command_has_the_setting_flags_it_uses() -> None:
    for args in (
        ("dead", "list"),
        ("dead", "requeue", "--all"),
        ("replay", "--all"),
        ("pause",),
        ("resume",),
        ("cleanup",),
        ("check",),
    ):
        ns = parse(*args, "--table", "events")
        assert cli.load_settings(ns).table == "events"
        assert callable(ns.handler)
    for args in (("dead", "requeue", "--all"), ("replay", "--all"), ("cleanup",), ("check",)):
        ns = parse(*args, "--cleanup-batch-size", "7")
        assert cli.load_settings(ns).cleanup_batch_size == 7
    # The bulk actions' batch is its own setting, and the cleanup's when unset.
    for args in (("dead", "requeue", "--all"), ("dead", "discard", "--all"), ("replay", "--all")):
        assert (
            cli.load_settings(parse(*args, "--action-batch-size", "9")).effective_action_batch_size
            == 9
        )
        fallback = cli.load_settings(parse(*args, "--cleanup-batch-size", "7"))
        assert fallback.effective_action_batch_size == 7
    with pytest.raises(SystemExit):
        parse("cleanup", "--action-batch-size", "9")  # retention's batch is cleanup_batch_size
