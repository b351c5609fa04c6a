"""The multi-node TP flags (--nnodes, --node-rank, --dist-init-addr, --dist-timeout):
each bad value or combination is refused naming its flag; the ranks a node runs; the
Engine and `pdserve up` (one machine's processes) refuse them."""

from __future__ import annotations

import pytest

from pdserve.config import ConfigError, ServerArgs
from pdserve.config_checks import parse_host_port
from pdserve.scheduler.worker import NODE_LOCAL_FIELDS, tp_init_method

pytestmark = pytest.mark.fast

ADDR = ("--dist-init-addr", "127.0.0.1:29500")


@pytest.mark.parametrize("argv, flag_name, why", [
    (["--tp-size", "4", "--nnodes", "3", *ADDR], "--nnodes", "does not divide --tp-size 4"),
    (["--tp-size", "2", "--nnodes", "4", *ADDR], "--nnodes", "does not divide --tp-size 2"),
    (["--nnodes", "0"], "--nnodes", "must be >= 1"),
    (["--tp-size", "4", "--nnodes", "2", "--node-rank", "2", *ADDR], "--node-rank", "must be in [0, 2)"),
    (["--tp-size", "4", "--nnodes", "2", "--node-rank", "-1", *ADDR], "--node-rank", "must be in [0, 2)"),
    (["--node-rank", "1"], "--node-rank", "for --nnodes 1"),
    (["--tp-size", "4", "--nnodes", "2"], "--dist-init-addr", "is required with --nnodes 2"),
    (["--tp-size", "4", "--nnodes", "2", "--dist-init-addr", "127.0.0.1"], "--dist-init-addr", "not HOST:PORT"),
    (["--tp-size", "4", "--nnodes", "2", "--dist-init-addr", "host:port"], "--dist-init-addr", "not HOST:PORT"),
    (["--tp-size", "4", "--nnodes", "2", "--dist-init-addr", "h:70000"], "--dist-init-addr", "not HOST:PORT"),
    (["--tp-size", "4", "--nnodes", "2", "--dist-init-addr", ":29500"], "--dist-init-addr", "not HOST:PORT"),
    (["--tp-size", "4", "--nnodes", "2", "--dist-init-addr", "::1:29500"], "--dist-init-addr", "in brackets"),
    (["--tp-size", "4", "--nnodes", "2", "--dist-init-addr", "a/b:29500"], "--dist-init-addr",
     "not a hostname"),
    (["--dist-timeout", "0"], "--dist-timeout", "must be > 0"),
    (["--dist-timeout", "inf"], "--dist-timeout", "must be > 0 and finite"),
    (["--nnodes", "two"], "--nnodes", "invalid int"),
    # A PD side spanning machines listens (bootstrap, transfer links) where the others reach it.
    (["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "10.0.0.1:29500", "--disaggregation-mode",
      "prefill", "--disaggregation-secret", "s" * 16], "--host", "loopback address"),
])
def test_bad_multinode_flags_name_the_flag(argv, flag_name, why):
    with pytest.raises(ConfigError) as exc:
        ServerArgs.from_cli(argv)
    assert str(exc.value).startswith(flag_name) or f"argument {flag_name}" in str(exc.value), str(exc.value)
    assert why in str(exc.value)


def test_each_node_runs_its_share_of_the_ranks():
    for node_rank, ranks in ((0, range(0, 2)), (1, range(2, 4))):
        args = ServerArgs.from_cli(["--tp-size", "4", "--nnodes", "2", "--node-rank", str(node_rank), *ADDR])
        assert args.node_tp_ranks() == ranks
        assert tp_init_method(args) == "tcp://127.0.0.1:29500"
    assert ServerArgs(tp_size=4).node_tp_ranks() == range(4)
    assert ServerArgs(tp_size=2, nnodes=2, node_rank=1, dist_init_addr="[::1]:80").dist_init_host_port() == ("::1", 80)
    assert tp_init_method(ServerArgs(dist_init_addr="[::1]:80")) == "tcp://[::1]:80"
    assert tp_init_method(ServerArgs()).startswith("tcp://127.0.0.1:")  # a free port of this machine
    # Not given: 300 s; the rendezvous alone (pdserve/model/parallel.py).
    assert ServerArgs().rendezvous_timeout() == 300.0 and ServerArgs(dist_timeout=5).rendezvous_timeout() == 5


def test_parse_host_port():
    assert parse_host_port("node0.example:29500") == ("node0.example", 29500)
    assert parse_host_port("[fe80::1]:1") == ("fe80::1", 1)
    for bad in ("", "h", "h:", "h:0", "[::1]", "h:-1"):
        with pytest.raises(ValueError):
            parse_host_port(bad)


def test_node_local_fields_are_fields():
    """The flags nodes may differ in (compared at startup, pdserve/scheduler/worker.py) exist."""
    names = {f for f in ServerArgs.__dataclass_fields__}
    assert NODE_LOCAL_FIELDS <= names and "tp_size" not in NODE_LOCAL_FIELDS


def test_engine_refuses_nnodes():
    from pdserve import Engine

    with pytest.raises(ConfigError, match="--nnodes: the offline Engine runs on one node"):
        Engine(tp_size=2, nnodes=2, dist_init_addr="127.0.0.1:29500")


@pytest.mark.parametrize("argv, name", [(["--nnodes", "2"], "--nnodes"), (["--node-rank=1"], "--node-rank"),
                                        (["--dist-init-addr", "h:1"], "--dist-init-addr"),
                                        (["--nn", "2"], "--nnodes"), (["--node-r=1"], "--node-rank"),
                                        (["--dist-i", "h:1"], "--dist-init-addr")])  # prefixes too
def test_up_refuses_multinode_flags(argv, name):
    from pdserve.up import parse_args

    with pytest.raises(ConfigError, match=f"^{name}: pdserve up starts one machine's deployment"):
        parse_args(argv)
