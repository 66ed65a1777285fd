from __future__ import annotations

import pytest

pytest.importorskip("pyspark")

from dualwrite.errors import (
    BatchTasksFailedError,
    FatalError,
    InvalidRecordError,
    RetriableError,
    UnknownTopicError,
)
from dualwrite.participant.kafka_errors import AuthorizationError
from dualwrite.spark._sink import task_exception, tasks_failed

pytestmark = pytest.mark.unit

CAUSE = """An exception was thrown from the Python worker. Please see the stack trace below.
Traceback (most recent call last):
  File "/x/dualwrite/spark/_task.py", line 201, in write_partition
psycopg.OperationalError: the connection is lost
\tIs the server running?

The above exception was the direct cause of the following exception:

"""
FINAL = """Traceback (most recent call last):
  File "/x/dualwrite/batch/prepared_writes.py", line 280, in write
    raw.close()
{name}: {message}

\tat org.apache.spark.api.python.BasePythonRunner.handlePythonException(PythonRunner.scala:1)
Caused by: java.lang.Exception: at the JVM side
"""


class PythonException(Exception):
    """Stands in for pyspark's: the task's traceback as text."""


def failed(name: str, message: str, cause: str = CAUSE) -> PythonException:
    return PythonException(cause + FINAL.format(name=name, message=message))


def test_the_task_s_final_exception_is_read_not_its_causes() -> None:
    assert task_exception(str(failed("dualwrite.errors.DatabaseUnreachableError",
                                     "cannot reach the database"))) == (
        "dualwrite.errors.DatabaseUnreachableError", "cannot reach the database")
    # An older dualwrite error in the chain does not name a later foreign one.
    chained = failed("RuntimeError", "boom", cause=FINAL.format(
        name="dualwrite.errors.InvalidRecordError", message="bad") + "\nDuring handling of the "
        "above exception, another exception occurred:\n\n")
    assert task_exception(str(chained)) == ("RuntimeError", "boom")
    assert task_exception("no traceback here") is None


def test_a_task_s_retriable_error_becomes_batch_tasks_failed() -> None:
    error = tasks_failed(failed("dualwrite.errors.DatabaseUnreachableError",
                                "cannot reach the database"), "s1", 7, "t")
    assert isinstance(error, BatchTasksFailedError) and isinstance(error, RetriableError)
    assert error.task_error == "DatabaseUnreachableError: cannot reach the database"
    assert "sink s1 batch 7" in str(error) and "nothing of it is visible" in str(error)


def test_a_task_s_fatal_error_stays_fatal() -> None:
    error = tasks_failed(failed("dualwrite.errors.InvalidRecordError", "key is a dict"),
                         "s1", 7, "t")
    assert type(error) is InvalidRecordError and error.topic == "t"
    assert "key is a dict" in str(error)
    error = tasks_failed(failed("dualwrite.errors.UnknownTopicError", "no topic"), "s1", 7, "t")
    assert type(error) is UnknownTopicError
    # A missing ACL on the transactional id (only the task's init_transactions meets it): its
    # class has an __init__ of its own, so the error is a FatalError naming it.
    error = tasks_failed(failed("dualwrite.participant.kafka_errors.AuthorizationError",
                                "TRANSACTIONAL_ID_AUTHORIZATION_FAILED"), "s1", 7, "t")
    assert isinstance(error, FatalError) and not isinstance(error, AuthorizationError)
    assert "(AuthorizationError)" in str(error)
    assert "TRANSACTIONAL_ID_AUTHORIZATION_FAILED" in str(error)


def test_a_failure_that_is_not_dualwrite_s() -> None:
    error = tasks_failed(failed("ZeroDivisionError", "division by zero"), "s1", 2, "t")
    assert isinstance(error, BatchTasksFailedError)
    assert error.task_error == "ZeroDivisionError: division by zero"
    error = tasks_failed(RuntimeError("Python worker exited unexpectedly (crashed)\nmore"),
                         "s1", 2, "t")
    assert isinstance(error, BatchTasksFailedError)
    assert error.task_error == "RuntimeError: Python worker exited unexpectedly (crashed)"
