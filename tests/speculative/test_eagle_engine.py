"""EAGLE / EAGLE3 speculative decoding in the engine: output identical to plain decoding
(greedy and seeded sampling) for chain and tree shapes, incremental KV equal to a
from-scratch recomputation, exact positions, oracle trees fully accepted, finishing
inside an accepted run, and pools back to full (make_engine checks) after every test."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.req import samples_from_message
from pdserve.speculative.eagle_worker import DraftTree
from pdserve.testing import build_random_draft, build_random_model

SHAPES = [(3, 1, 4), (5, 4, 8), (4, 3, 12), (6, 2, 10)]
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("spec_t"), "llama", num_layers=4, num_heads=4,
                              num_kv_heads=2, hidden_size=64)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, target) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafts")
    return {"EAGLE": build_random_draft(target, root / "e", "EAGLE", seed=1),
            "EAGLE3": build_random_draft(target, root / "e3", "EAGLE3", draft_vocab_size=60, seed=2)}


def prompts(n: int, lo: int = 4, hi: int = 60, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 95) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def spec(drafts: dict[str, Path], algo: str, shape: tuple[int, int, int] | None = None, **kw: Any) -> dict[str, Any]:
    out = dict(speculative_algorithm=algo, speculative_draft_model_path=str(drafts[algo]), **kw)
    if shape is not None:
        out.update(speculative_num_steps=shape[0], speculative_eagle_topk=shape[1],
                   speculative_num_draft_tokens=shape[2])
    return out


_REF: dict[Any, Any] = {}


def reference(make_engine, target: Path, ps: list[list[int]], params: dict[str, Any], **kw: Any) -> list[dict]:
    key = (str(target), str(ps), str(sorted(params.items())), str(sorted(kw.items())))
    if key not in _REF:
        _REF[key] = make_engine(target, **kw).generate(input_ids=ps, sampling_params=params)
    return _REF[key]


def ids_of(results: list[dict]) -> list[list[int]]:
    return [r["output_ids"] for r in results]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"S{s}k{k}N{n}" for s, k, n in SHAPES])
@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_greedy_equals_plain_batched_and_single(make_engine, target, drafts, algo, shape):
    ps = prompts(6)
    ref = reference(make_engine, target, ps, GREEDY)
    engine = make_engine(target, **spec(drafts, algo, shape))
    got = engine.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(got) == ids_of(ref)
    for p, r in zip(ps[:2], ref[:2]):
        one = engine.generate(input_ids=p, sampling_params=GREEDY)
        assert one["output_ids"] == r["output_ids"]
        assert one["meta_info"]["spec_verify_ct"] >= 1
    accept = engine._scheduler.state()["avg_spec_accept_length"]
    assert 1.0 <= accept <= shape[0] + 1


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_and_cache_hits(make_engine, target, drafts, algo, page_size):
    base = prompts(1, 70, 71, seed=5)[0]
    ps = [base + p for p in prompts(4, 3, 30, seed=6)] + prompts(2, 40, 90, seed=7)
    ref = reference(make_engine, target, ps, GREEDY)
    engine = make_engine(target, chunked_prefill_size=16, page_size=page_size, **spec(drafts, algo, (4, 2, 6)))
    assert ids_of(engine.generate(input_ids=ps, sampling_params=GREEDY)) == ids_of(ref)
    # Again: every prompt now hits the radix cache (draft KV rebuilt from stored features).
    again = engine.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(again) == ids_of(ref)
    assert all(r["meta_info"]["cached_tokens"] > 0 for r in again)


def test_retraction_n_samples_logprobs_and_stops(make_engine, target, drafts):
    ps = prompts(8, 30, 60, seed=9)
    params = dict(GREEDY, max_new_tokens=40)
    ref = reference(make_engine, target, ps, params)
    # Room for every prompt and each round's tree, but only for a quarter of the
    # generated tokens: decode runs out of pages and must retract.
    prompt_tokens = sum(len(p) + 1 for p in ps)
    growth = sum(params["max_new_tokens"] for _ in ps)
    engine = make_engine(target, max_total_tokens=prompt_tokens + len(ps) * 5 + growth // 4,
                         **spec(drafts, "EAGLE", (3, 2, 5)))
    assert ids_of(engine.generate(input_ids=ps, sampling_params=params)) == ids_of(ref)
    assert engine._scheduler.queues.num_retractions > 0
    # n > 1 (seeded sampling), logprobs and stop conditions: identical to plain decoding.
    cases = [
        ({"temperature": 1.0, "n": 3, "seed": 11, "max_new_tokens": 20, "ignore_eos": True}, False, 0),
        ({"temperature": 0, "max_new_tokens": 12}, True, 3),
        ({"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 5, "max_new_tokens": 16,
          "frequency_penalty": 0.5, "presence_penalty": 0.3, "min_new_tokens": 6}, True, 2),
    ]
    plain = make_engine(target)
    fast = make_engine(target, **spec(drafts, "EAGLE3", (4, 3, 8)))
    for params, lp, top in cases:
        a = plain.generate(input_ids=ps[:3], sampling_params=params, return_logprob=lp, top_logprobs_num=top)
        b = fast.generate(input_ids=ps[:3], sampling_params=params, return_logprob=lp, top_logprobs_num=top)
        assert ids_of(a) == ids_of(b)
        if lp:
            for x, y in zip(a, b):
                lx = [v for v, _, _ in x["meta_info"]["output_token_logprobs"]]
                ly = [v for v, _, _ in y["meta_info"]["output_token_logprobs"]]
                assert lx == pytest.approx(ly, abs=1e-4)
                tx = [[t for _, t, _ in s] for s in x["meta_info"]["output_top_logprobs"]]
                assert tx == [[t for _, t, _ in s] for s in y["meta_info"]["output_top_logprobs"]]
    # Stop token / stop string somewhere in the output.
    out = ref[0]["output_ids"]
    for params in ({"temperature": 0, "max_new_tokens": 40, "stop_token_ids": [out[7]]},
                   {"temperature": 0, "max_new_tokens": 40, "stop": [plain.tokenizer.decode(out[9:11])]}):
        a = plain.generate(input_ids=ps[0], sampling_params=params)
        b = fast.generate(input_ids=ps[0], sampling_params=params)
        assert (a["output_ids"], a["text"], a["meta_info"]["finish_reason"]) == \
            (b["output_ids"], b["text"], b["meta_info"]["finish_reason"])


@pytest.mark.parametrize("algo,shape", [("EAGLE", (3, 1, 4)), ("EAGLE3", (5, 4, 8)), ("EAGLE", (6, 2, 10))],
                         ids=["EAGLE-chain", "EAGLE3-S5k4N8", "EAGLE-S6k2N10"])
def test_batched_round_equals_the_per_view_round(make_engine, target, drafts, algo, shape, monkeypatch):
    """The batched round (draws with penalties and min-token bans, accept walk and KV
    compaction on the device, one read) gives the same tokens, logprobs, finish
    reasons and accept counts as the per-node view round it replaces for every
    request without a grammar."""
    from pdserve.scheduler.batch import Sampler

    ps = prompts(5, 5, 50, seed=31)
    cases = [dict(GREEDY, max_new_tokens=30),
             {"temperature": 0.9, "top_p": 0.8, "top_k": 12, "min_p": 0.02, "seed": 3, "max_new_tokens": 25,
              "ignore_eos": True, "n": 2},
             {"temperature": 0, "max_new_tokens": 40, "stop_token_ids": [7, 11, 19]},
             {"temperature": 1.0, "seed": 8, "max_new_tokens": 30, "frequency_penalty": 0.6,
              "presence_penalty": 0.3, "repetition_penalty": 1.3, "min_new_tokens": 12, "stop_token_ids": [5, 9]}]

    def run(batched: bool) -> list[Any]:
        monkeypatch.setattr(Sampler, "tree_drawable", lambda self, reqs: batched)
        engine = make_engine(target, page_size=4, **spec(drafts, algo, shape))
        rounds = []
        for params in cases:
            outs = engine.generate(input_ids=ps, sampling_params=params, return_logprob=True, top_logprobs_num=2)
            rounds.append([(o["output_ids"], o["meta_info"]["finish_reason"], o["meta_info"].get("spec_verify_ct", 0),
                            o["meta_info"].get("spec_accepted_drafts", 0),
                            [round(v, 4) for v, _, _ in o["meta_info"]["output_token_logprobs"]],
                            [[t for _, t, _ in top] for top in o["meta_info"]["output_top_logprobs"]])
                           for o in outs])
        return rounds

    views, batched = run(False), run(True)
    assert batched == views
    assert any(verify < len(ids) for ids, _, verify, *_ in batched[0])  # drafts were accepted


def test_sampling_distribution_matches_plain(make_engine, target, drafts):
    """Temperature 1 on the small-vocabulary model: the distribution of the 2nd and 3rd
    tokens (drawn inside speculative rounds) over many seeds agrees with plain decoding."""
    p = prompts(1, 12, 13, seed=21)[0]
    runs = 300
    params = [{"temperature": 1.0, "seed": s, "max_new_tokens": 3, "ignore_eos": True} for s in range(runs)]
    plain = make_engine(target).generate(input_ids=[p] * runs, sampling_params=params)
    fast = make_engine(target, **spec(drafts, "EAGLE", (3, 2, 5))).generate(input_ids=[p] * runs,
                                                                              sampling_params=params)
    # Seeded draws are reproduced exactly (the verify draw is plain decoding's draw)...
    assert ids_of(plain) == ids_of(fast)
    # ...and, what losslessness means, the histograms agree (chi-square, pooled rare bins).
    for pos in (1, 2):
        a = [r["output_ids"][pos] for r in plain]
        b = [r["output_ids"][pos] for r in fast]
        cats = sorted(set(a) | set(b))
        ca = [a.count(c) for c in cats]
        cb = [b.count(c) for c in cats]
        chi = sum((x - y) ** 2 / (x + y) for x, y in zip(ca, cb) if x + y > 0)
        dof = max(1, len(cats) - 1)
        assert chi < dof + 4 * math.sqrt(2 * dof), (chi, dof)


def _tree(parents: list[int], tokens: list[int]) -> tuple[list[int], list[list[bool]]]:
    n = len(parents)
    depth = [0] * n
    mask = [[False] * n for _ in range(n)]
    mask[0][0] = True
    for j in range(1, n):
        depth[j] = depth[parents[j]] + 1
        mask[j] = list(mask[parents[j]])
        mask[j][j] = True
    return depth, mask


def oracle_propose(worker, truth: dict[str, list[int]], depth: int):
    """A propose() whose tree holds the true continuation (`depth` tokens deep) on a
    branch that is not the first child, with decoy siblings around it."""
    nodes = worker.num_draft_tokens

    def propose(reqs):
        toks, pars, deps, masks = [], [], [], []
        for r in reqs:
            full = truth[r.rid]
            done = len(r.output_ids)
            nxt = full[done: done + depth] + [7] * depth
            tokens, parents = [r.output_ids[-1]], [-1]
            last = 0
            for d in range(depth):
                if len(tokens) < nodes - (depth - d):  # a decoy sibling first when there is room
                    tokens.append((nxt[d] + 1) % 90 + 5)
                    parents.append(last)
                tokens.append(nxt[d])
                parents.append(last)
                last = len(tokens) - 1
            while len(tokens) < nodes:
                tokens.append(5)
                parents.append(0)
            dep, mask = _tree(parents, tokens)
            toks.append(tokens), pars.append(parents), deps.append(dep), masks.append(mask)
        t = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt)  # noqa: E731
        return DraftTree(t(toks), t(pars), t(deps), t(masks, torch.bool))
    return propose


@pytest.mark.parametrize("shape", [(3, 1, 4), (4, 2, 8)])
def test_oracle_tree_is_fully_accepted_and_finishes_inside_a_run(make_engine, target, drafts, shape):
    steps = shape[0]
    ps = prompts(3, 10, 30, seed=31)
    ref = reference(make_engine, target, ps, GREEDY)
    engine = make_engine(target, **spec(drafts, "EAGLE", shape))
    sched = engine._scheduler
    worker = sched.spec
    truth: dict[str, list[int]] = {}
    orig_group = engine.builder.group

    def group(ids, p, *a, **k):  # remember each request's true continuation by rid
        msg = orig_group(ids, p, *a, **k)
        truth[msg.rid] = ref[[tuple(x) for x in ps].index(tuple(ids))]["output_ids"]
        return msg
    engine.builder.group = group
    worker.propose = oracle_propose(worker, truth, steps)
    got = engine.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(got) == ids_of(ref)
    # First token from prefill, then every round emits steps + 1 (all drafts + bonus).
    for r in got:
        assert r["meta_info"]["spec_verify_ct"] == math.ceil((GREEDY["max_new_tokens"] - 1) / (steps + 1))
    assert worker.avg_accept_length > steps  # the last round may be cut by max_new_tokens
    # max_new_tokens inside an accepted run: output cut exactly there, pools full afterwards.
    params = dict(GREEDY, max_new_tokens=steps + 3)
    cut = engine.generate(input_ids=ps[0], sampling_params=params)
    assert cut["output_ids"] == ref[0]["output_ids"][: steps + 3]
    assert cut["meta_info"]["finish_reason"]["type"] == "length"
    stop = engine.generate(input_ids=ps[0], sampling_params={"temperature": 0, "max_new_tokens": 30,
                                                             "stop_token_ids": [ref[0]["output_ids"][3]]})
    first = ref[0]["output_ids"].index(ref[0]["output_ids"][3])
    assert stop["output_ids"] == ref[0]["output_ids"][: first + 1]


def test_positions_first_draft_step_at_seq_len(make_engine, target, drafts):
    engine = make_engine(target, **spec(drafts, "EAGLE3", (3, 2, 6)))
    worker = engine._scheduler.spec
    seen: list[tuple[bool, list[int]]] = []
    orig_forward = worker.draft.forward

    def record(ids, hidden, ctx, from_target):
        seen.append((from_target, ctx.positions.tolist()))
        return orig_forward(ids, hidden, ctx, from_target)
    worker.draft.forward = record
    orig_verify = worker.verify_input
    verify_pos: list[tuple[int, list[int], list[int]]] = []

    def verify(reqs, tree):
        fwd = orig_verify(reqs, tree)
        verify_pos.append((reqs[0].kv_len, fwd.positions.tolist(), tree.depths[0].tolist()))
        return fwd
    worker.verify_input = verify
    p = prompts(1, 20, 21, seed=3)[0]
    engine.generate(input_ids=p, sampling_params=dict(GREEDY, max_new_tokens=8))
    # Prefill draft extend: rows 0..L-1 at positions 0..L-1.
    assert seen[0] == (True, list(range(len(p))))
    n0 = len(p)  # KV length when the first round starts (the first token is not in KV yet)
    steps = [pos for ft, pos in seen[1:] if not ft]
    assert steps[0] == [n0, n0]  # both top-k frontier nodes of draft step 1 at position seq_len
    assert steps[1] == [n0 + 1, n0 + 1]
    kv, pos, depths = verify_pos[0]
    assert kv == n0 and pos == [n0 + d for d in depths]


def test_incremental_kv_equals_recomputation(make_engine, target, drafts):
    """After every verify round the target KV, the draft KV and the carried draft state
    equal what a fresh prefill of the same tokens produces."""
    ps = prompts(3)
    ref = reference(make_engine, target, ps, GREEDY)
    for algo in ("EAGLE", "EAGLE3"):
        engine = make_engine(target, **spec(drafts, algo, (3, 2, 6)), page_size=4)
        fresh = make_engine(target, **spec(drafts, algo, (3, 2, 6)), page_size=4)
        assert assert_state_equals_fresh_prefill(engine, fresh, ps, [r["output_ids"] for r in ref]) >= 3


def assert_state_equals_fresh_prefill(engine, fresh, ps: list[list[int]], truth: list[list[int]],
                                      max_rounds: int = 6) -> int:
    """Step ``engine``'s scheduler through verify rounds whose trees hold the true
    continuation (``truth``, per prompt) on a later branch, so every round accepts drafts
    whose KV must be moved into place; after each round compare the target KV, every
    layer of the draft KV and the carried draft state with a prefill of the same tokens
    on ``fresh`` (same configuration). Returns the number of rounds compared."""
    sched, ref_sched = engine._scheduler, fresh._scheduler
    reqs = [samples_from_message(engine.builder.group(p, SamplingParams.from_dict(GREEDY), False, 0))[0]
            for p in ps]
    sched.spec.propose = oracle_propose(sched.spec, {r.rid: t for r, t in zip(reqs, truth)}, 3)
    for r in reqs:
        sched.add(r)
    rounds = 0
    while sched.has_work and rounds < max_rounds:
        out = sched.step()
        if not sched.running or any(r.kv_len == len(r.prompt_ids) for r in out.advanced):
            continue  # a prefill step
        rounds += 1
        for r in sched.running:
            probe = samples_from_message(
                fresh.builder.group(r.fill_ids[: r.kv_len], SamplingParams.from_dict(GREEDY), False, 0))[0]
            ref_sched.add(probe)
            ref_sched.step()
            assert probe.output_ids == [r.output_ids[-1]]  # the same next token
            a = sched.kv.req_table.table[r.row, : r.kv_len]
            b = ref_sched.kv.req_table.table[probe.row, : r.kv_len]
            pools = [(sched.kv.kv_pool, ref_sched.kv.kv_pool), (sched.spec.draft_pool, ref_sched.spec.draft_pool)]
            for mine, theirs in pools:
                for layer in range(len(mine.k)):
                    torch.testing.assert_close(mine.k[layer][a], theirs.k[layer][b], atol=1e-4, rtol=1e-4)
                    torch.testing.assert_close(mine.v[layer][a], theirs.v[layer][b], atol=1e-4, rtol=1e-4)
            assert r.draft_len == r.kv_len
            mine, theirs = sched.spec.carried(r), ref_sched.spec.carried(probe)
            torch.testing.assert_close(mine.hidden, theirs.hidden, atol=1e-4, rtol=1e-4)
            assert mine.topk_index.tolist() == theirs.topk_index.tolist()
            ref_sched.abort(probe.rid)
    for r in list(sched.running) + list(sched.waiting):
        sched.abort(r.rid)
    return rounds


def test_bad_speculative_flags_are_refused(target, drafts):
    from pdserve import Engine
    from pdserve.config import ConfigError, ServerArgs

    with pytest.raises(ConfigError, match="--speculative-draft-model-path"):  # no head ships with it
        ServerArgs(model_path=str(target), speculative_algorithm="EAGLE")
    with pytest.raises(ConfigError, match="together"):
        ServerArgs(**spec(drafts, "EAGLE"), speculative_num_steps=3)
    with pytest.raises(ConfigError, match="--speculative-num-draft-tokens"):
        ServerArgs(**spec(drafts, "EAGLE", (2, 2, 9)))
    with pytest.raises(ConfigError, match="--speculative-algorithm"):
        ServerArgs(speculative_draft_model_path=str(drafts["EAGLE"]))
    with pytest.raises(ConfigError, match="--speculative-algorithm"):
        ServerArgs.from_cli(["--speculative-algorithm", "MEDUSA"])
    # k = 1 is a chain: N is forced to S + 1.
    assert ServerArgs(**spec(drafts, "EAGLE", (3, 1, 9))).speculative_shape("LlamaForCausalLM") == (3, 1, 4)
    with pytest.raises(ValueError, match="EAGLE3 draft"):
        Engine(model_path=str(target), speculative_algorithm="EAGLE",
               speculative_draft_model_path=str(drafts["EAGLE3"]))


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_demo_heads_equal_plain_and_accept(make_engine, algo):
    """The embedded demo model with its trained heads: identical greedy output for every
    shape (mixed batch, chunked prefill, then cache hits), and real acceptance."""
    from pdserve import assets
    from pdserve.assets import demo_tasks

    tok = make_engine(assets.path("demo")).tokenizer
    convs = [c for t in (*demo_tasks.TASKS, "multi-turn") for c in demo_tasks.heldout_conversations(t, 3, 2)]
    ps = [tok(tok.apply_chat_template(list(c.messages), add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"] for c in convs]
    params = {"max_new_tokens": 40, "temperature": 0}
    ref = reference(make_engine, assets.path("demo"), ps, params)
    head = str(assets.path("demo-eagle" if algo == "EAGLE" else "demo-eagle3"))
    for shape in SHAPES:
        engine = make_engine(assets.path("demo"), chunked_prefill_size=48, speculative_algorithm=algo,
                             speculative_draft_model_path=head, speculative_num_steps=shape[0],
                             speculative_eagle_topk=shape[1], speculative_num_draft_tokens=shape[2])
        assert ids_of(engine.generate(input_ids=ps, sampling_params=params)) == ids_of(ref), shape
        assert ids_of(engine.generate(input_ids=ps, sampling_params=params)) == ids_of(ref), shape
        assert engine._scheduler.state()["avg_spec_accept_length"] > 1.5, shape
        one = engine.generate(input_ids=ps[-1], sampling_params=params)  # a single request, cache hit
        assert one["output_ids"] == ref[-1]["output_ids"], shape
