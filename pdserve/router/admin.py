"""Worker management at run time: what POST /workers accepts, and the one add / remove
path that the HTTP API and Kubernetes discovery share.

    POST   /workers        {"url": "http://10.0.0.5:30000", "role": "prefill", "bootstrap_port": 8998}
    DELETE /workers/{url}  (the URL percent-encoded) drain, then remove
    GET    /workers        every worker: role, state, since when, in-flight legs
    GET    /workers/{url}  one worker (404 once it is gone)

Roles: "prefill" and "decode" on a PD router, "worker" (a colocated server) on a plain
one. `bootstrap_port` is for prefill workers only and reads as the `--prefill URL PORT`
flag does: absent means 8998 (the servers' default), null or "none" lets the servers
use their own default. A URL already registered is a 409 (not idempotent: a second add
with another role or port would otherwise silently keep the first), except that adding a
worker that is being removed, with the same role and port, calls the removal off.

These are admin routes (KeyCheck in app.py): whoever may add a worker decides where every
client's prompts and the router's keys go. The URL takes one canonical form (urls.py:
`localhost`, `127.1`, `2130706433` and `0.0.0.0` are all http://127.0.0.1:PORT), without
credentials, at most 2048 characters; the router's own address is refused (400), and an
add that fails leaves nothing registered.
"""

from __future__ import annotations

from typing import Any

from pdserve.router.config import DEFAULT_BOOTSTRAP_PORT, ConfigError, WorkerSpec, normalise_url, \
    parse_bootstrap_port
from pdserve.router.limits import Refusal

API_ROLES = {"prefill": "prefill", "decode": "decode", "worker": "plain"}  # API name -> registry role
FIELDS = ("url", "role", "bootstrap_port")


def spec_from_body(body: dict[str, Any], pd: bool) -> WorkerSpec:
    """The worker a POST /workers body describes, or a Refusal (400) naming the field."""
    unknown = next((k for k in body if k not in FIELDS), None)
    if unknown is not None:
        raise Refusal(f"{unknown}: unknown field (expected {', '.join(FIELDS)})", unknown)
    url = body.get("url")
    if not isinstance(url, str):
        raise Refusal("url: required, a string such as http://10.0.0.5:30000", "url")
    try:
        url = normalise_url(url, "url")
    except ConfigError as exc:
        raise Refusal(str(exc), "url") from None
    role = body.get("role")
    allowed = ("prefill", "decode") if pd else ("worker",)
    if role not in allowed:
        mode = "a PD router (--pd-disaggregation)" if pd else "a plain router (colocated servers)"
        raise Refusal(f"role: {role!r} is not one of {', '.join(allowed)} on {mode}", "role")
    if role != "prefill":
        if body.get("bootstrap_port") is not None:
            raise Refusal(f"bootstrap_port: only prefill workers have one (this is a {role} worker)",
                          "bootstrap_port")
        return WorkerSpec(url, API_ROLES[role])
    port: int | None = DEFAULT_BOOTSTRAP_PORT
    if "bootstrap_port" in body:
        value = body["bootstrap_port"]
        try:
            port = None if value is None else parse_bootstrap_port(value, "bootstrap_port")
        except ConfigError as exc:
            raise Refusal(str(exc), "bootstrap_port") from None
    return WorkerSpec(url, "prefill", port)
