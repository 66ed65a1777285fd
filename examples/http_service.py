"""An HTTP order service on Starlette with dualwrite's async writer pool.

``POST /orders`` with ``{"order_id": "...", "amount_cents": 1200}`` writes an ``http_orders`` row
and an event on the topic in one atomic request (``AsyncDualWriterPool``, group commit), and
answers ``201`` once both are committed. ``order_id``: a non-empty string of at most 64
characters; ``amount_cents``: an integer from 0 to 2147483647; no other field. Anything else (no
body, not JSON, a missing or wrong field) is a ``400`` with ``{"error": "..."}``, before the
pool is touched; ``409`` an order id that exists, ``503`` a retriable failure (retry it).
``GET /health`` answers ``200`` once the pool is up; ``GET /metrics`` serves Prometheus metrics
with the ``metrics`` extra (``pip install 'dualwrite[metrics]'``).

    python examples/http_service.py --db URL -b HOST:PORT --topic orders [--port 8000] [--size 8]

``--db``: PostgreSQL, MariaDB (``mysql://``, with the ``mariadb`` extra) or SQLite, as dualwrite
takes it; the app's own engine gets the async driver of that database (:func:`async_url`).

The pool claims its ids ``http-orders-0`` .. ``http-orders-{size-1}`` at start (it prints them
with the URL it serves) and finishes what a previous process left in doubt; see
examples/README.md for the crash-and-recover walkthrough.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import sqlalchemy as sa
import uvicorn
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import dualwrite as dw
from dualwrite import metrics

metadata = sa.MetaData()
orders = sa.Table("http_orders", metadata,
                  sa.Column("order_id", sa.String(64), primary_key=True),
                  sa.Column("amount_cents", sa.Integer, nullable=False))
MAX_ORDER_ID = 64
MAX_AMOUNT = 2**31 - 1  # the column's INTEGER


class BadRequest(Exception):
    """The request's body is not an order (answered with 400)."""


def parse_order(raw: bytes) -> tuple[str, int]:
    """``(order_id, amount_cents)`` of a request body, or :class:`BadRequest` saying why not."""
    try:
        body: Any = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadRequest('the body must be a JSON object: {"order_id": "...", '
                         '"amount_cents": 1200}') from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, not {type(body).__name__}")
    missing = sorted({"order_id", "amount_cents"} - body.keys())
    if missing:
        raise BadRequest(f"missing field(s): {', '.join(missing)}")
    unknown = sorted(body.keys() - {"order_id", "amount_cents"})
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(unknown)}")
    order_id, amount = body["order_id"], body["amount_cents"]
    if not isinstance(order_id, str) or not order_id or len(order_id) > MAX_ORDER_ID:
        raise BadRequest(f"order_id must be a non-empty string of at most {MAX_ORDER_ID} "
                         "characters")
    if isinstance(amount, bool) or not isinstance(amount, int) or not 0 <= amount <= MAX_AMOUNT:
        raise BadRequest(f"amount_cents must be an integer from 0 to {MAX_AMOUNT}")
    return order_id, amount


def async_url(db_url: str) -> sa.URL:
    """The URL with an async driver: psycopg 3 (async) on PostgreSQL, aiosqlite on SQLite,
    aiomysql on MariaDB (``mysql://``, ``mysql+pymysql://``, ``mariadb+pymysql://`` …: the
    dialect name is kept; the ``mariadb`` extra installs aiomysql)."""
    url = sa.make_url(db_url)
    if url.drivername == "postgresql":
        return url.set(drivername="postgresql+psycopg")
    if url.drivername in ("sqlite", "sqlite+pysqlite"):
        return url.set(drivername="sqlite+aiosqlite")
    dialect, _, driver = url.drivername.partition("+")
    if dialect in ("mysql", "mariadb") and driver not in ("aiomysql", "asyncmy"):
        return url.set(drivername=f"{dialect}+aiomysql")
    return url


def make_app(db_url: str, bootstrap: str, topic: str, size: int = 8,
             id_prefix: str = "http-orders", url: str | None = None,
             hooks: dw.PhaseHooks | None = None) -> Starlette:
    """The app; ``url``, the address it serves, is printed with the pool's ids at start;
    ``hooks`` go to the pool's writers (tests kill the process at a phase with them)."""
    engine = create_async_engine(async_url(db_url))  # the service's own async engine
    pool = dw.AsyncDualWriterPool(engine, {"bootstrap.servers": bootstrap}, id_prefix=id_prefix,
                                  size=size, hooks=hooks)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        await asyncio.to_thread(dw.upgrade_database, db_url)
        async with engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
        await pool.start()  # claims the ids, finishes what they left in doubt
        ids = pool.pool.transactional_ids
        print(f"http_service: serving {url or '(no url given)'} with transactional ids "
              f"{ids[0]}..{ids[-1]} ({len(ids)}), topic {topic}", flush=True)
        try:
            yield
        finally:
            await pool.close()
            await engine.dispose()

    async def create_order(request: Request) -> Response:
        try:
            order_id, amount = parse_order(await request.body())
        except BadRequest as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        event = json.dumps({"order_id": order_id, "amount_cents": amount})
        try:
            async with pool.transaction() as tx:
                tx.produce(topic, event, order_id)
                await tx.connection.execute(orders.insert(), {"order_id": order_id,
                                                             "amount_cents": amount})
        except sa.exc.IntegrityError:
            return JSONResponse({"error": "order exists"}, status_code=409)
        except dw.RetriableError as exc:
            return JSONResponse({"error": str(exc), "type": type(exc).__name__},
                                status_code=503)
        return JSONResponse({"order_id": order_id}, status_code=201)

    async def health(_request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def prometheus(_request: Request) -> Response:
        return Response(metrics.exposition(everything=True), media_type=metrics.CONTENT_TYPE)

    routes = [Route("/orders", create_order, methods=["POST"]), Route("/health", health)]
    if metrics.ENABLED:  # the `metrics` extra: dualwrite's families and the process's
        routes.append(Route("/metrics", prometheus))
    return Starlette(routes=routes, lifespan=lifespan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("-b", "--bootstrap", required=True)
    ap.add_argument("--topic", default="orders")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--size", type=int, default=8)
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    uvicorn.run(make_app(args.db, args.bootstrap, args.topic, args.size, url=url),
                host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
