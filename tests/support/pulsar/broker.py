"""One Pulsar standalone broker (``LocalPulsar``, transactions on) for a test package's
``pulsar_broker`` fixture; it needs java, javac and mvn, and its tests are skipped otherwise."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from dualwrite.dev.pulsar_cluster import LocalPulsar

HAS_JAVA = all(shutil.which(t) for t in ("java", "javac", "mvn"))


def local_pulsar() -> Iterator[LocalPulsar]:
    """Start a broker, yield it, stop it (the body of a package-scoped fixture)."""
    if not HAS_JAVA:
        pytest.skip("needs java, javac and mvn (Pulsar from Maven jars)")
    from dualwrite.dev.pulsar_cluster import DEFAULT_PULSAR_VERSION, LocalPulsar

    with LocalPulsar(DEFAULT_PULSAR_VERSION) as broker:
        yield broker


def hs256_token(secret: bytes, subject: str) -> str:
    """A JWT for role ``subject`` signed with ``secret``, as Pulsar's token provider checks."""
    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).decode().rstrip("=")

    signing = b64(b'{"alg":"HS256"}') + "." + b64(json.dumps({"sub": subject}).encode())
    return signing + "." + b64(hmac.new(secret, signing.encode(), hashlib.sha256).digest())


@contextlib.contextmanager
def token_auth_pulsar(key_dir: Path, roles: tuple[str, ...],
                      super_role: str) -> Iterator[tuple[LocalPulsar, dict[str, str]]]:
    """A broker with token authentication and authorization on: ``roles`` may produce and
    consume in ``public/default`` (and look up ``pulsar/system``), ``super_role`` is a super
    user. Yields the broker and each role's token."""
    if not HAS_JAVA:
        pytest.skip("needs java, javac and mvn (Pulsar from Maven jars)")
    from dualwrite.dev.pulsar_cluster import DEFAULT_PULSAR_VERSION, LocalPulsar

    secret = os.urandom(32)
    key = key_dir / "secret.key"
    key.write_bytes(secret)
    tokens = {role: hs256_token(secret, role) for role in (*roles, super_role)}
    config = {
        "authenticationEnabled": "true",
        "authorizationEnabled": "true",
        "authenticationProviders":
            "org.apache.pulsar.broker.authentication.AuthenticationProviderToken",
        "tokenSecretKey": key.as_uri(),
        "superUserRoles": super_role,
        "brokerClientAuthenticationPlugin":
            "org.apache.pulsar.client.impl.auth.AuthenticationToken",
        "brokerClientAuthenticationParameters": f"token:{tokens[super_role]}",
    }
    with LocalPulsar(DEFAULT_PULSAR_VERSION, extra_config=config,
                     admin_token=tokens[super_role]) as pulsar:
        for role in roles:
            for ns, actions in (("public/default", ["produce", "consume"]),
                                ("pulsar/system", ["consume"])):
                status, body = pulsar.admin_request(
                    "POST", f"/admin/v2/namespaces/{ns}/permissions/{role}", actions)
                assert status == 204, (status, body)
        yield pulsar, tokens
