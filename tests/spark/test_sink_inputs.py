"""ExactlyOnceSink given a batch that does not fit it: a typed error naming what is missing, and
nothing written or decided (a driver in this process: no task ever runs)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pyspark.sql import SparkSession

import dualwrite
from dualwrite.batch.decision_log import DecisionLog
from dualwrite.errors import ConfigurationError
from dualwrite.spark import ExactlyOnceSink
from tests.support.kafka import read_committed


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = (SparkSession.builder.master("local[1]").appName("sink-inputs")
               .config("spark.ui.enabled", "false").getOrCreate())
    yield session
    session.stop()


@pytest.mark.parametrize("missing", ["key_column", "value_column"])
def test_a_column_the_batch_lacks_is_a_configuration_error(
        spark: Any, bootstrap: str, topic: str, sqlite_url: str, missing: str) -> None:
    columns = {"key_column": "id", "value_column": "payload", missing: "no_such_column"}
    sink = ExactlyOnceSink(sink_id="inputs", kafka_config={"bootstrap.servers": bootstrap},
                           topic=topic, database_url=sqlite_url,
                           key_column=columns["key_column"], value_column=columns["value_column"])
    df = spark.createDataFrame([("1", "a"), ("2", "b")], "id STRING, payload STRING")
    try:
        with pytest.raises(ConfigurationError, match="no_such_column") as raised:
            sink(df, 0)
    finally:
        sink.close()
    assert f"{missing}='no_such_column'" in str(raised.value)
    assert read_committed(bootstrap, topic) == []
    engine = dualwrite.create_engine(sqlite_url)
    try:
        log = DecisionLog(engine)
        assert not log.has_tables() or log.read("inputs") is None
    finally:
        engine.dispose()
