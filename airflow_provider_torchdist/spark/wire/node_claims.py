"""A node's own credential for its claims on the run channel, where no scheduler vouches for it.

Over Spark Connect the driver cannot ask Spark's scheduler which host runs a task, and the run's
token is in every task of the job. So an elastic run's driver gives each node a **claim secret**
of its own: HMAC(a random secret only the driver holds, the node's number), shipped in the job's
input row for that node's partition alone (a task receives its own partition's rows, and every
task the closure). A claim is a challenge: the driver sends a nonce, the node answers with an HMAC
under its claim secret over the nonce and its claims, so the secret never crosses the executors'
network and a recorded answer cannot be replayed. The keys the driver then hands the node (its
node key, the run's elastic key) come back wrapped under the same secret and nonce.

Standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

#: Every key the driver hands a node is this long (``secrets.token_bytes(32)``).
KEY_BYTES = 32


def claim_secret(run_secret: bytes, node: int) -> bytes:
    """Node ``node``'s claim secret, derived from the driver's ``run_secret``."""
    return hmac.new(run_secret, f"torchdist node claim {node}".encode(), hashlib.sha256).digest()


def claim_proof(secret: bytes, nonce: str, hello: dict[str, Any]) -> str:
    """The node's answer to the driver's challenge: HMAC(its claim secret, nonce and the hello's claims)."""
    claims = ["claim", nonce, hello.get("node"), hello.get("task"), hello.get("host")]
    return hmac.new(secret, json.dumps(claims).encode(), hashlib.sha256).hexdigest()


def wrap_key(secret: bytes, nonce: str, label: str, key: bytes) -> bytes:
    """``key`` XORed with a pad only the holder of ``secret`` can make for this ``nonce`` and
    ``label`` (a fresh nonce per claim, one label per key: no pad is used twice). Its own inverse."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a key the driver hands a node is {KEY_BYTES} bytes, not {len(key)}")
    pad = hmac.new(secret, json.dumps(["wrap", label, nonce]).encode(), hashlib.sha256).digest()
    return bytes(a ^ b for a, b in zip(key, pad, strict=True))
