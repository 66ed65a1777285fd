"""The soak's HTTP service: ``examples/http_service.py``'s app as the example runs it, its pool's
writers given :class:`~tests.soak.roles.KillAfterDatabaseCommit`, any error the app does not
answer itself answered ``500`` with its class and family (the load journals them), and every
exception uvicorn logs (a failed start, an error the app let out) printed as a
``SOAK-UNCAUGHT`` line (the verdict counts those that are not dualwrite's).

    python -m tests.soak.service_role --db URL -b HOST:PORT --topic T --port P [--size N]
"""

from __future__ import annotations

import argparse
import logging

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tests.soak.roles import UNCAUGHT, KillAfterDatabaseCommit, report_uncaught, role_logging
from tests.support import example
from tests.support.journal import family

ID_PREFIX = "soak-orders"


async def unexpected_error(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": str(exc)[:300], "type": type(exc).__name__,
                         "family": family(exc)}, status_code=500)


class UvicornErrors(logging.Handler):
    """uvicorn's logged exceptions (a failed start, an error the app let out) as
    ``SOAK-UNCAUGHT`` lines: they never reach ``sys.excepthook``."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            print(f"{UNCAUGHT} {type(exc).__module__}.{type(exc).__qualname__} {family(exc)}",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("-b", "--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--size", type=int, default=4)
    args = ap.parse_args()
    report_uncaught()
    role_logging()
    logging.getLogger("uvicorn.error").addHandler(UvicornErrors())
    url = f"http://127.0.0.1:{args.port}"
    app = example("http_service").make_app(args.db, args.bootstrap, args.topic, args.size,
                                  id_prefix=ID_PREFIX, url=url, hooks=KillAfterDatabaseCommit())
    app.add_exception_handler(Exception, unexpected_error)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
