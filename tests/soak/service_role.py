"""The soak's HTTP service: ``examples/http_service.py``'s app as the example runs it, its pool's
writers given :class:`~tests.soak.roles.KillAfterDatabaseCommit`, and any error the app does not
answer itself answered ``500`` with its class and family (the load journals them).

    python -m tests.soak.service_role --db URL -b HOST:PORT --topic T --port P [--size N]
"""

from __future__ import annotations

import argparse

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tests.soak.roles import KillAfterDatabaseCommit
from tests.support import example
from tests.support.journal import family

ID_PREFIX = "soak-orders"


async def unexpected_error(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": str(exc)[:300], "type": type(exc).__name__,
                         "family": family(exc)}, status_code=500)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("-b", "--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--size", type=int, default=4)
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    app = example("http_service").make_app(args.db, args.bootstrap, args.topic, args.size,
                                  id_prefix=ID_PREFIX, url=url, hooks=KillAfterDatabaseCommit())
    app.add_exception_handler(Exception, unexpected_error)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
