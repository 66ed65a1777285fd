"""PreparedTxnState: the text stored in the state table that names one prepared transaction.

Pure logic, no broker: the text round-trips, stays within the 255-character column even for a
249-character topic name (the anchor's topic is then hashed), accepts the Java client's
``"<producerId>:<epoch>"`` form and ``""``, and rejects anything else with an error that quotes
the text.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualwrite import InvalidPreparedStateError, PreparedTxnState
from dualwrite.errors import FatalError
from dualwrite.participant.identifiers import TopicPartition
from dualwrite.participant.prepared_state import MAX_STATE_LENGTH, Anchor, topic_digest

pytestmark = pytest.mark.unit

TOPIC_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1

producer_ids = st.integers(min_value=0, max_value=INT64_MAX)
epochs = st.integers(min_value=0, max_value=32767)
topics = st.text(alphabet=TOPIC_CHARS, min_size=1, max_size=249)
partitions = st.integers(min_value=0, max_value=INT32_MAX)
offsets = st.integers(min_value=0, max_value=INT64_MAX)


# -- round trip ------------------------------------------------------------------------------


@given(producer_ids, epochs, topics, partitions, offsets)
def test_round_trip_with_anchor(
    pid: int, epoch: int, topic: str, partition: int, offset: int
) -> None:
    tp = TopicPartition(topic, partition)
    state = PreparedTxnState.of(pid, epoch, tp, offset)
    text = str(state)
    assert len(text) <= MAX_STATE_LENGTH
    assert text.startswith(f"dw1:{pid}:{epoch}:")
    assert text.endswith(f":{partition}:{offset}")
    parsed = PreparedTxnState.parse(text)
    assert parsed == state
    assert str(parsed) == text
    assert not parsed.is_empty
    assert parsed.anchor is not None
    assert parsed.anchor.matches(tp)
    assert parsed.anchor.offset == offset
    assert parsed.anchor.resolve({tp, TopicPartition(topic + "x", partition)}) == tp


@given(producer_ids, epochs)
def test_round_trip_java_form(pid: int, epoch: int) -> None:
    state = PreparedTxnState(pid, epoch)
    assert str(state) == f"{pid}:{epoch}"
    assert PreparedTxnState.parse(f"{pid}:{epoch}") == state
    assert PreparedTxnState.parse(f"{pid}:{epoch}").anchor is None


@given(st.text(max_size=300))
def test_arbitrary_text_parses_or_raises_invalid_state(text: str) -> None:
    """Whatever is in the column, parse() never fails with anything but its own error."""
    try:
        state = PreparedTxnState.parse(text)
    except InvalidPreparedStateError as exc:
        assert exc.text == text
        assert repr(text) in str(exc)
    else:
        assert len(str(state)) <= MAX_STATE_LENGTH


def test_java_form_example() -> None:
    state = PreparedTxnState.parse("4711:3")
    assert (state.producer_id, state.epoch, state.anchor) == (4711, 3, None)
    assert not state.is_empty
    assert str(state) == "4711:3"


def test_of_without_partition_is_java_form() -> None:
    state = PreparedTxnState.of(12, 4, None, None)
    assert str(state) == "12:4"
    assert state.anchor is None


# -- empty -----------------------------------------------------------------------------------


def test_empty_state_is_empty_text() -> None:
    assert str(PreparedTxnState()) == ""
    assert str(PreparedTxnState.empty()) == ""
    assert PreparedTxnState.empty().is_empty
    parsed = PreparedTxnState.parse("")
    assert parsed.is_empty
    assert parsed == PreparedTxnState.empty()
    assert parsed.anchor is None


def test_constructor_rejects_half_set_identity() -> None:
    with pytest.raises(ValueError):
        PreparedTxnState(5, -1)
    with pytest.raises(ValueError):
        PreparedTxnState(-1, 5)
    with pytest.raises(ValueError):
        PreparedTxnState(-1, -1, Anchor("t", 0, 0))


# -- length bound and hashed anchor ---------------------------------------------------------


def test_249_char_topic_is_hashed_and_fits() -> None:
    topic = "t" * 249
    tp = TopicPartition(topic, 7)
    state = PreparedTxnState.of(INT64_MAX, 32767, tp, INT64_MAX)
    text = str(state)
    assert len(text) <= MAX_STATE_LENGTH
    assert topic not in text
    assert state.anchor is not None
    assert state.anchor.topic == topic_digest(topic)
    assert state.anchor.topic.startswith("#") and len(state.anchor.topic) == 17
    parsed = PreparedTxnState.parse(text)
    assert parsed == state
    assert parsed.anchor is not None
    assert parsed.anchor.matches(tp)
    assert not parsed.anchor.matches(TopicPartition(topic, 8))
    assert not parsed.anchor.matches(TopicPartition("t" * 248, 7))
    # resolve() finds the real partition among those the coordinator lists
    others = {TopicPartition("u" * 249, 7), TopicPartition(topic, 6), tp}
    assert parsed.anchor.resolve(others) == tp
    assert parsed.anchor.resolve({TopicPartition("u" * 249, 7)}) is None


def test_short_topic_is_kept_in_clear() -> None:
    tp = TopicPartition("orders", 2)
    state = PreparedTxnState.of(42, 1, tp, 100)
    assert str(state) == "dw1:42:1:orders:2:100"
    assert state.anchor == Anchor("orders", 2, 100)
    assert state.anchor.matches(tp)
    assert not state.anchor.matches(TopicPartition("orders", 3))
    assert not state.anchor.matches(TopicPartition("orders2", 2))


def test_topic_hashed_exactly_when_clear_text_would_not_fit() -> None:
    pid, epoch, partition, offset = 1, 0, 0, 0
    overhead = len(f"dw1:{pid}:{epoch}::{partition}:{offset}")
    fits = "a" * (MAX_STATE_LENGTH - overhead)
    too_long = fits + "a"
    kept = PreparedTxnState.of(pid, epoch, TopicPartition(fits, partition), offset)
    assert len(str(kept)) == MAX_STATE_LENGTH
    assert kept.anchor is not None and kept.anchor.topic == fits
    hashed = PreparedTxnState.of(pid, epoch, TopicPartition(too_long, partition), offset)
    assert hashed.anchor is not None and hashed.anchor.topic == topic_digest(too_long)
    assert len(str(hashed)) < MAX_STATE_LENGTH


# -- malformed -------------------------------------------------------------------------------

MALFORMED = [
    "garbage",
    "1",
    "1:2:3",
    "1:x",
    "x:1",
    "-1:0",
    "1:-1",
    "1:32768",
    ":",
    "1:",
    " 1:2",
    "1:2 ",
    "dw1:1:2:topic:0",
    "dw1:1:2:topic:0:0:0",
    "dw2:1:2:topic:0:0",
    "dw1:1:2:top ic:0:0",
    "dw1:1:2::0:0",
    "dw1:1:2:topic:-1:0",
    "dw1:1:2:topic:0:-5",
    "dw1:1:2:topic:a:0",
    "dw1:-1:2:topic:0:0",
    "dw1:1:2:#abc:0:0",
    "dw1:1:2:" + "t" * 250 + ":0:0",
    "1:" + "9" * 300,
    "12345678901234567890:1",
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_text_raises_quoting_it(text: str) -> None:
    with pytest.raises(InvalidPreparedStateError) as info:
        PreparedTxnState.parse(text)
    exc = info.value
    assert isinstance(exc, ValueError)
    assert isinstance(exc, FatalError)
    assert exc.text == text
    assert repr(text) in str(exc)
    assert exc.reason and exc.reason in str(exc)


@pytest.mark.parametrize("text", ["1:5\n", "dw1:1:2:topic\n:0:0", "dw1:1:2:topic:0:0\n"])
def test_trailing_newline_is_malformed(text: str) -> None:
    with pytest.raises(InvalidPreparedStateError):
        PreparedTxnState.parse(text)


def test_non_string_raises() -> None:
    with pytest.raises(InvalidPreparedStateError):
        PreparedTxnState.parse(None)  # type: ignore[arg-type]
    with pytest.raises(InvalidPreparedStateError):
        PreparedTxnState.parse(b"1:2")  # type: ignore[arg-type]
