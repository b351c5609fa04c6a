"""Building a prefill or decode server's scheduler rank: its transfer engine, control
link, and side of the protocol composed into the one scheduler; a prefill server's
rank 0 also runs the bootstrap registry and every rank registers in it, on whichever
node it runs (each advertises its own node's --host).

``pdserve.scheduler.mode.SCHEDULER_MODES`` names these builders (imported lazily, so
the scheduler package imports nothing of this one)."""

from __future__ import annotations

import secrets
from typing import Any, Callable

from pdserve.config import ServerArgs
from pdserve.disagg.bootstrap import BootstrapServer, fetch_ranks, reachable_host, register_rank
from pdserve.disagg.decode_side import decode_scheduler
from pdserve.disagg.engines import make_transfer_engine
from pdserve.disagg.manager import LinkConfig
from pdserve.disagg.prefill_side import PrefillSide, prefill_scheduler
from pdserve.disagg.protocol import Authenticator
from pdserve.disagg.rooms import Deadlines
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ModelRunner
from pdserve.scheduler.scheduler import Scheduler


def _link_and_engine(args: ServerArgs) -> tuple[LinkConfig, str, Any]:
    link = LinkConfig(
        heartbeat_interval_s=args.disaggregation_heartbeat_interval,
        heartbeat_misses=args.disaggregation_heartbeat_misses,
        handshake_timeout_s=args.disaggregation_bootstrap_timeout,
        deadlines=Deadlines(args.disaggregation_bootstrap_timeout, args.disaggregation_waiting_timeout,
                            args.disaggregation_transfer_timeout),
        secret=args.control_secret())
    host = reachable_host(args.host)  # what peers dial: never a wildcard address
    engine = make_transfer_engine(args.disaggregation_transfer_backend, host=host,
                                  ib_device=args.disaggregation_ib_device or "", log_level=args.log_level)
    return link, host, engine


def build_decode_scheduler(args: ServerArgs, runner: ModelRunner, decode_text: Callable[[list[int]], str],
                           tp: TPGroup) -> Scheduler:
    link, host, engine = _link_and_engine(args)
    secret = link.secret
    listing_auth = Authenticator(secret, f"decode-rank{tp.rank}") if secret is not None else None
    return decode_scheduler(args, runner, decode_text, engine,
                            lambda url: fetch_ranks(url, args.disaggregation_bootstrap_timeout, listing_auth),
                            tp, host=host, link=link)


def build_prefill_scheduler(args: ServerArgs, runner: ModelRunner, decode_text: Callable[[list[int]], str],
                            tp: TPGroup) -> Scheduler:
    link, host, engine = _link_and_engine(args)
    secret = link.secret
    sched = prefill_scheduler(args, runner, decode_text, engine, tp, host=host, link=link)
    side = sched.mode
    assert isinstance(side, PrefillSide)
    # The registry accepts only this server's ranks: rank 0 draws a key and shares it
    # over the TP group (nothing outside this server ever sees it), with the address its
    # registry is reached at: with --nnodes > 1 some ranks run on other machines.
    key, registry_host = tp.broadcast_object(  # type: ignore[misc]
        (secrets.token_bytes(32), host) if tp.rank == 0 else None)
    registry_auth = Authenticator(key, f"prefill-rank{tp.rank}")  # type: ignore[arg-type]
    if tp.rank == 0:
        side.bootstrap = BootstrapServer(args.host, args.disaggregation_bootstrap_port, registry_auth,
                                         Authenticator(secret, "bootstrap") if secret is not None else None)
    register_rank(f"http://{registry_host}:{args.disaggregation_bootstrap_port}",
                  side.manager.rank_info(tp.size, host), registry_auth, args.disaggregation_bootstrap_timeout)
    return sched
