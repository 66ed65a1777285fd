"""No secret (Kafka credentials, database password) appears in the repr or str of what dualwrite
pickles to Spark executors; the pickled object itself keeps them."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("pyspark")

from dualwrite.spark._task import TaskPlan

pytestmark = pytest.mark.unit

SECRETS = {
    "sasl.password": "s3cret-XYZ",
    "ssl.key.password": "keypw-XYZ",
    "ssl.key.pem": "-----BEGIN PRIVATE KEY-----pem-XYZ",
    "sasl.oauthbearer.client.secret": "oauth-XYZ",
    "sasl.oauthbearer.config": "principal=me token=tok-XYZ",
    "sasl.jaas.config": "jaas-XYZ",
}


def _plan(url: str | None) -> TaskPlan:
    return TaskPlan("sink", 7, "orders",
                    {"bootstrap.servers": "127.0.0.1:9092", "sasl.username": "alice", **SECRETS},
                    url, "orders", ("id",), 12.5)


@pytest.mark.parametrize("url", ["postgresql://u:pw-XYZ@host/db",
                                 "postgresql+psycopg://u:pw-XYZ@host:5432/db?sslmode=require",
                                 "postgresql://u@host/db?password=qpw-XYZ&sslpassword=s-XYZ"])
def test_task_plan_repr_masks_secrets(url: str) -> None:
    plan = _plan(url)
    for text in (repr(plan), str(plan), f"{plan}", f"{plan!r}", repr([plan])):
        assert "XYZ" not in text, text
        assert "127.0.0.1:9092" in text and "alice" in text and "host" in text  # still useful
        assert "***" in text


def test_task_plan_repr_without_url_and_with_an_unparsable_one() -> None:
    assert "database_url=None" in repr(_plan(None))
    assert "XYZ" not in repr(_plan("not a url: pw-XYZ"))


def test_task_plan_pickles_with_its_secrets() -> None:
    plan = _plan("postgresql://u:pw-XYZ@host/db")
    again = pickle.loads(pickle.dumps(plan))
    assert again == plan
    assert again.producer_config["sasl.password"] == "s3cret-XYZ"
    assert again.database_url == "postgresql://u:pw-XYZ@host/db"


def test_mask_url_hides_passwords_in_the_query_string_too() -> None:
    from dualwrite.database import mask_url

    masked = mask_url("postgresql://app:pw-XYZ@127.0.0.1/shop?password=q-XYZ&sslpassword=s-XYZ"
                      "&sslmode=require")
    assert "XYZ" not in masked and "sslmode=require" in masked
