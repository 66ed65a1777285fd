"""An HTTP order service on Starlette with dualwrite's async writer pool.

``POST /orders`` with ``{"order_id": "...", "amount_cents": 1200}`` writes an ``http_orders`` row
and an event on the topic in one atomic request (``AsyncDualWriterPool``, group commit), and
answers ``201`` once both are committed. ``GET /health`` answers ``200`` once the pool is up.

    python examples/http_service.py --db URL -b HOST:PORT --topic orders [--port 8000] [--size 8]

The pool claims its ids ``http-orders-{n}`` at start and finishes what a previous process left
in doubt; see examples/README.md for the crash-and-recover walkthrough.
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

metadata = sa.MetaData()
orders = sa.Table("http_orders", metadata,
                  sa.Column("order_id", sa.String(64), primary_key=True),
                  sa.Column("amount_cents", sa.Integer, nullable=False))


def async_url(db_url: str) -> sa.URL:
    """The URL with an async driver: psycopg 3 (async) on PostgreSQL, aiosqlite on SQLite."""
    url = sa.make_url(db_url)
    if url.drivername == "postgresql":
        return url.set(drivername="postgresql+psycopg")
    if url.drivername in ("sqlite", "sqlite+pysqlite"):
        return url.set(drivername="sqlite+aiosqlite")
    return url


def make_app(db_url: str, bootstrap: str, topic: str, size: int = 8,
             id_prefix: str = "http-orders") -> Starlette:
    engine = create_async_engine(async_url(db_url))  # the service's own async engine
    pool = dw.AsyncDualWriterPool(engine, {"bootstrap.servers": bootstrap}, id_prefix=id_prefix,
                                  size=size)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        await asyncio.to_thread(dw.upgrade_database, db_url)
        async with engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
        await pool.start()  # claims the ids, finishes what they left in doubt
        try:
            yield
        finally:
            await pool.close()
            await engine.dispose()

    async def create_order(request: Request) -> Response:
        body: dict[str, Any] = await request.json()
        order_id, amount = str(body["order_id"]), int(body["amount_cents"])
        try:
            async with pool.transaction() as tx:
                tx.produce(topic, json.dumps(body), order_id)
                await tx.connection.execute(orders.insert(), {"order_id": order_id,
                                                             "amount_cents": amount})
        except sa.exc.IntegrityError:
            return JSONResponse({"error": "order exists"}, status_code=409)
        except dw.RetriableError as exc:
            return JSONResponse({"error": str(exc)}, status_code=503)
        return JSONResponse({"order_id": order_id}, status_code=201)

    async def health(_request: Request) -> Response:
        return JSONResponse({"ok": True})

    return Starlette(routes=[Route("/orders", create_order, methods=["POST"]),
                             Route("/health", health)], lifespan=lifespan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("-b", "--bootstrap", required=True)
    ap.add_argument("--topic", default="orders")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--size", type=int, default=8)
    args = ap.parse_args()
    uvicorn.run(make_app(args.db, args.bootstrap, args.topic, args.size), host="127.0.0.1",
                port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
