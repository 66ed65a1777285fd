"""The soak (issue 34): every role at once on one cluster and one database, under mixed,
overlapping faults, then checked by Kafka's own clients.

``./run.sh soak [--minutes N] [--faults N] [--seed S]`` (``python -m tests.soak``) starts a
3-broker Kafka from the jars and a PostgreSQL server of its own (``--db mariadb``: MariaDB), and
four roles as processes of their own, each reaching Kafka and the database only through loopback
proxies: the HTTP order service (``examples/http_service.py``, its async pool with group commit)
under load, an exactly-once consumer turning the service's order events into payment rows and
``paid`` records, the Spark orders pipeline (``spark/orders_pipeline.py``: its generated orders,
validated and enriched, into a table and a topic through ``ExactlyOnceSink``), and ``dualwrite
recover --watch`` with ``--metrics-port``. A supervisor starts every role again when it exits, as
an init system would. Four lanes inject faults, each on its own schedule from the seed, so faults
overlap: brokers (SIGKILL, SIGSTOP/SIGCONT, the coordinator's and a partition leader's too, rolling
restarts), the network (connections cut, delayed, an EndTxn answer lost, a Produce held, a database
COMMIT's answer lost), the database (immediate restarts, sessions terminated) and the roles
(SIGKILL at random or right after their database COMMIT).

At the end the roles stop, ``dualwrite recover`` runs, and :mod:`tests.soak.verify` checks every
table against its topic with Kafka's Java console consumer (read_committed) and
``kafka-transactions.sh``: see :mod:`tests.soak.runner` for the invariant. The report (text and
HTML with a timeline) goes to the output folder.
"""
