"""KV staged through host twins of the transfer buffers (what a GPU with Mooncake's
non-CUDA build uses), exercised on CPU: the mode is chosen at startup and refused where it
cannot work; a staged pair, or a staged side paired with a direct one, gives the
colocated engine's greedy outputs, with speculative decode and a decode prefix hit."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import ConfigError, ServerArgs
from pdserve.disagg.staging import HostStaging, choose_staging
from pdserve.disagg.decode_side import decode_scheduler
from pdserve.disagg.prefill_side import prefill_scheduler
from tests.disagg.test_pd_prefix_reuse import first_turns, second_turns
from tests.disagg.test_pd_schedulers import GREEDY, dirs, pools_full, prompts, run_pair, sched  # noqa: F401


@pytest.mark.fast
def test_the_mode_is_chosen_at_startup_and_impossible_ones_are_refused():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert choose_staging("auto", cpu, False) == "direct" and choose_staging("host", cpu, True) == "host"
    assert choose_staging("auto", gpu, reaches_device_memory=True) == "direct"
    assert choose_staging("auto", gpu, reaches_device_memory=False) == "host"
    assert choose_staging("host", gpu, reaches_device_memory=True) == "host"
    with pytest.raises(ValueError, match="--disaggregation-kv-staging direct: .*non-cuda"):
        choose_staging("direct", gpu, reaches_device_memory=False)
    with pytest.raises(ConfigError, match="--disaggregation-kv-staging"):
        ServerArgs(disaggregation_kv_staging="pinned")
    assert ServerArgs.from_cli(["--disaggregation-mode", "decode", "--disaggregation-kv-staging", "host"]
                               ).disaggregation_kv_staging == "host"


@pytest.mark.fast
def test_host_staging_copies_exactly_the_named_slots():
    device_buf = torch.arange(40, dtype=torch.float32).view(10, 4)
    staging = HostStaging()
    twin = staging.twin("kv", device_buf)
    assert twin.data_ptr() != device_buf.data_ptr() and twin.shape == device_buf.shape
    twin.fill_(-7.0)  # a twin starts uninitialized: its other slots are never read
    staging.stage_out([2, 7])
    assert torch.equal(twin[[2, 7]], device_buf[[2, 7]]) and (twin[[0, 1, 3, 4, 5, 6, 8, 9]] == -7).all()
    twin[5] = -1.0
    staging.stage_in([5])
    assert (device_buf[5] == -1).all() and device_buf[4, 0] == 16.0


@pytest.mark.parametrize("p_staging,d_staging,p_algo,d_algo,extra", [
    ("host", "host", None, None, {}),
    ("host", "direct", None, "EAGLE", {}),
    ("direct", "host", "EAGLE", "EAGLE", {"page_size": 16}),
    ("host", "host", None, "EAGLE3", {"page_size": 16}),
], ids=["host-host", "host-direct-eagle", "direct-host-eagle-page16", "host-host-eagle3-page16"])
def test_staged_pairs_equal_colocated(make_engine, dirs, p_staging, d_staging, p_algo, d_algo, extra):
    ps = prompts(6, seed=3)
    engine = make_engine(dirs["target"], **extra)
    ref = [r["output_ids"] for r in engine.generate(input_ids=ps, sampling_params=GREEDY)]
    p = sched(prefill_scheduler, dirs, p_algo, {**extra, "chunked_prefill_size": 16,
                                               "disaggregation_kv_staging": p_staging})
    d = sched(decode_scheduler, dirs, d_algo, {**extra, "disaggregation_kv_staging": d_staging},
              fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    try:
        for s, mode in ((p, p_staging), (d, d_staging)):
            assert (s.mode.staging is not None) == (mode == "host")
        if d.mode.staging is not None:  # the engine writes into the twins, not into the pool
            registered = {b.name: b.ptr for b in d.mode.manager.layout.buffers}
            for name, (buffer, twin) in d.mode.staging.pairs.items():
                assert registered[name] == twin.data_ptr() != buffer.data_ptr()
        assert run_pair(p, d, ps) == ref
        # A second turn that hits decode's prefix cache: only the rest is staged in.
        answers = run_pair(p, d, first_turns(2, seed=4))
        turn2 = second_turns(first_turns(2, seed=4), answers, seed=5)
        want = [r["output_ids"] for r in engine.generate(input_ids=turn2, sampling_params=GREEDY)]
        hits = d.mode.prefix_hit_tokens
        assert run_pair(p, d, turn2) == want and d.mode.prefix_hit_tokens > hits
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()
