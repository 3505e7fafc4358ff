from __future__ import annotations

import pytest
from pydantic import ValidationError

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.kafka import failures
from outbox_dispatcher.models import Failure
from outbox_dispatcher.routing import Router, check_template


def test_the_rows_own_topic_wins() -> None:
    router = Router("fallback", "events.{type}")
    assert router.topic_for("orders", {"type": "x"}) == "orders"


def test_template_from_headers_then_default_topic() -> None:
    router = Router("fallback", "events.{aggregate}.{version}")
    assert router.topic_for(None, {"aggregate": "order", "version": "v2"}) == "events.order.v2"
    assert router.topic_for(None, {"aggregate": "order"}) == "fallback"


def test_unroutable_rows_say_why() -> None:
    with pytest.raises(errors.RoutingError, match="lacks header\\(s\\) aggregate"):
        Router(None, "events.{aggregate}").topic_for(None, {})
    with pytest.raises(errors.RoutingError, match="neither OUTBOX_TOPIC_TEMPLATE nor"):
        Router(None, None).topic_for(None, {"aggregate": "x"})
    with pytest.raises(errors.RoutingError, match="not a valid topic name"):
        Router("fallback", "events.{aggregate}").topic_for(None, {"aggregate": "no spaces"})


def test_routing_errors_dead_letter_at_once() -> None:
    assert failures.classify(errors.RoutingError()) is Failure.PERMANENT


@pytest.mark.parametrize("template", ["events", "bad topic.{x}", "events.{x", "{x}}"])
def test_invalid_templates_are_rejected(template: str) -> None:
    with pytest.raises(ValueError, match="OUTBOX_TOPIC_TEMPLATE"):
        check_template(template)


def test_settings_validate_routing() -> None:
    assert Settings(topic_template="events.{type}").topic_template == "events.{type}"
    with pytest.raises(ValidationError, match="OUTBOX_DEFAULT_TOPIC"):
        Settings(default_topic="no spaces")


def test_internal_topic_names_are_not_valid_topics() -> None:
    from outbox_dispatcher import routing

    assert not routing.valid_topic("__consumer_offsets")
    assert not routing.valid_topic("__transaction_state")
    assert routing.valid_topic("_single-underscore")
    assert routing.valid_topic("orders__v2")


def test_an_unbalanced_brace_in_the_template_is_named_as_such() -> None:
    import pytest

    from outbox_dispatcher import routing

    for template in ("events.{nope", "events.nope}", "events.{{a}}", "a}{b"):
        with pytest.raises(ValueError, match="unbalanced"):
            routing.check_template(template)
    assert routing.check_template("events.{aggregate}") == "events.{aggregate}"
