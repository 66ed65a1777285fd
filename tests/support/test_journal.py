from __future__ import annotations

import pytest

from dualwrite.errors import DatabaseUnreachableError, OutcomeUnknownError
from dualwrite.participant.kafka_errors import RetriableKafkaError
from tests.support.journal import dualwrite_error_class, family, family_of_class

pytestmark = pytest.mark.unit


def test_error_classes_by_name_and_their_families() -> None:
    assert dualwrite_error_class("DatabaseUnreachableError") is DatabaseUnreachableError
    assert dualwrite_error_class("RetriableKafkaError") is RetriableKafkaError
    for other in ("KeyError", "annotations", "KafkaErrorInfo", "nope"):
        assert dualwrite_error_class(other) is None
    assert family_of_class(RetriableKafkaError) == "retriable"
    assert family(OutcomeUnknownError("x")) == "recoverable"
    assert family(KeyError("x")) == "foreign"
