from __future__ import annotations

import pytest

from dualwrite.errors import (
    BatchTasksFailedError,
    InvalidRecordError,
    RetriableError,
    UnknownTopicError,
)
from dualwrite.spark._sink import tasks_failed

pytestmark = pytest.mark.unit

TRACE = """An exception was thrown from the Python worker:
Traceback (most recent call last):
  File "/x/dualwrite/spark/_task.py", line 201, in write_partition
psycopg.OperationalError: the connection is lost

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/x/dualwrite/batch/prepared_writes.py", line 280, in write
dualwrite.errors.{name}: {message}
"""


class PythonException(Exception):
    """Stands in for pyspark's: the task's traceback as text."""


def test_a_task_s_retriable_error_becomes_batch_tasks_failed() -> None:
    exc = PythonException(TRACE.format(name="DatabaseUnreachableError",
                                       message="cannot reach the database"))
    error = tasks_failed(exc, "s1", 7, "t")
    assert isinstance(error, BatchTasksFailedError) and isinstance(error, RetriableError)
    assert error.task_error == "DatabaseUnreachableError: cannot reach the database"
    assert "sink s1 batch 7" in str(error) and "nothing of it is visible" in str(error)


def test_a_task_s_fatal_error_keeps_its_class() -> None:
    exc = PythonException(TRACE.format(name="InvalidRecordError", message="key is a dict"))
    error = tasks_failed(exc, "s1", 7, "t")
    assert type(error) is InvalidRecordError and error.topic == "t"
    assert "key is a dict" in str(error)
    exc = PythonException(TRACE.format(name="UnknownTopicError", message="no topic t"))
    assert type(tasks_failed(exc, "s1", 7, "t")) is UnknownTopicError


def test_a_failure_without_a_dualwrite_error() -> None:
    error = tasks_failed(RuntimeError("Python worker exited unexpectedly (crashed)\nmore"),
                         "s1", 2, "t")
    assert isinstance(error, BatchTasksFailedError)
    assert error.task_error == "RuntimeError: Python worker exited unexpectedly (crashed)"
