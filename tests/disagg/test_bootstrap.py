"""The bootstrap registry: ranks register, decode lists them once all are there, bad
registrations are refused, an absent server is a timely error."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from pdserve.disagg import protocol as P
from pdserve.disagg.bootstrap import BootstrapError, BootstrapServer, fetch_ranks, register_rank
from pdserve.disagg.layout import PROTOCOL_VERSION, BufferSpec, CompatRecord, KVLayout

COMPAT = CompatRecord(PROTOCOL_VERSION, "LlamaForCausalLM", 4, 4, 32, "float32", 1, 104)


def rank(i: int, size: int = 2) -> P.RankInfo:
    return P.RankInfo(i, size, "127.0.0.1", 7000 + i, f"127.0.0.1:{16000 + i}", COMPAT,
                      KVLayout(1, (BufferSpec("target.L0.K", 4096 * (i + 1), 100, 256),)))


@pytest.fixture
def server():
    s = BootstrapServer("127.0.0.1", 0)
    yield s
    s.close()


def test_ranks_listed_once_all_registered(server):
    url = f"http://127.0.0.1:{server.port}"
    register_rank(url, rank(1))
    with pytest.raises(BootstrapError, match="1 of 2"):
        fetch_ranks(url, deadline_s=0.3)
    register_rank(url, rank(0))
    assert fetch_ranks(url, deadline_s=1) == [rank(0), rank(1)]


def test_bad_registrations_are_refused(server):
    url = f"http://127.0.0.1:{server.port}"
    register_rank(url, rank(0, 2))
    with pytest.raises(BootstrapError, match="tp_size"):
        register_rank(url, rank(1, 4))
    with pytest.raises(BootstrapError, match="tp_rank 3"):
        register_rank(url, rank(3, 2))
    req = urllib.request.Request(url + "/ranks", data=b'{"v": %d, "type": "Abort", "body": {}}' % PROTOCOL_VERSION, method="PUT")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=5)
    assert err.value.code == 400 and "missing field" in json.loads(err.value.read())["error"]
    with urllib.request.urlopen(url + "/health", timeout=5) as r:  # still serving
        assert r.status == 200


def test_unreachable_bootstrap_fails_within_deadline():
    t0 = time.monotonic()
    with pytest.raises(BootstrapError, match="did not list"):
        fetch_ranks("http://127.0.0.1:1", deadline_s=0.5)
    assert time.monotonic() - t0 < 5
    with pytest.raises(BootstrapError, match="unreachable"):
        register_rank("http://127.0.0.1:1", rank(0), timeout_s=1)
