"""The one mapping of librdkafka errors (participant/kafka_errors.py), as pure logic.

Behaviour against brokers is proven elsewhere (test_lost_responses, the fault suite); these pin
which librdkafka errors end only a producer session, and which end the producer for good.
"""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from dualwrite.errors import FatalError, ProducerFencedError
from dualwrite.participant.kafka_errors import ends_only_the_session, librdkafka_error

pytestmark = pytest.mark.unit


def _fatal(code: int) -> KafkaException:
    return KafkaException(KafkaError(code, "injected", fatal=True))


def test_a_lost_sequence_ends_only_the_session() -> None:
    """What a Produce held past the request timeout gave in the fault suite."""
    exc = _fatal(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER)
    assert ends_only_the_session(exc)
    # Raised from a delivery callback, confluent-kafka wraps it in a SystemError.
    wrapped = SystemError("error return without exception set")
    wrapped.__cause__ = exc
    assert ends_only_the_session(wrapped)


@pytest.mark.parametrize("code", [KafkaError._FENCED, KafkaError.PRODUCER_FENCED,
                                  KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED])
def test_fences_and_missing_acls_end_the_producer(code: int) -> None:
    exc = _fatal(code)
    assert not ends_only_the_session(exc)
    assert isinstance(librdkafka_error(exc, "flush"), FatalError)
    if code != KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED:
        assert isinstance(librdkafka_error(exc, "flush"), ProducerFencedError)


def test_errors_that_are_not_fatal_are_not_session_ending() -> None:
    assert not ends_only_the_session(KafkaException(KafkaError(KafkaError._TIMED_OUT)))
    assert not ends_only_the_session(RuntimeError("not librdkafka"))
