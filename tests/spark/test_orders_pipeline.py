"""spark/orders_pipeline.py's options (its runs are the demo's, the README's and the soak's)."""

from __future__ import annotations

from typing import Any

import pytest

import dualwrite.spark
from dualwrite.errors import BrokerUnreachableError, DatabaseUnreachableError
from tests.support import script

pytestmark = pytest.mark.unit

pipeline = script("spark", "orders_pipeline")


def test_kafka_config_reaches_the_sink(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--kafka-config`` (security, timeouts) goes to the sink's Kafka clients; the bootstrap
    stays ``--bootstrap``."""
    given: dict[str, Any] = {}

    def sink(**kw: Any) -> object:
        given.update(kw)
        return object()

    monkeypatch.setattr(dualwrite.spark, "ExactlyOnceSink", sink)
    config = pipeline.parse_args([
        "-b", "127.0.0.1:9092", "--kafka-config", "security.protocol=SASL_SSL",
        "--kafka-config", "sasl.jaas.config=a=b", "--kafka-config",
        "bootstrap.servers=elsewhere:1"])
    assert config.kafka_config["sasl.jaas.config"] == "a=b"  # split at the first '=' only
    pipeline.make_sink(config)
    assert given["kafka_config"] == {"security.protocol": "SASL_SSL",
                                     "sasl.jaas.config": "a=b",
                                     "bootstrap.servers": "127.0.0.1:9092"}


def test_kafka_config_without_a_value_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        pipeline.parse_args(["-b", "127.0.0.1:9092", "--kafka-config", "acks"])
    assert "--kafka-config takes KEY=VALUE" in capsys.readouterr().err


def test_no_broker_at_start_is_a_typed_error() -> None:
    """The pipeline's own setup fails as the sink would: retriable, and saying where."""
    with pytest.raises(BrokerUnreachableError, match=r"127\.0\.0\.1:1"):
        pipeline.ensure_topic("127.0.0.1:1", "orders", 1, timeout_s=0.5)


def test_no_database_at_start_is_a_typed_error() -> None:
    with pytest.raises(DatabaseUnreachableError) as raised:
        pipeline.ensure_orders_table("postgresql+psycopg://u:secret@127.0.0.1:1/db")
    assert "secret" not in str(raised.value)
