"""The embedded demo model: loadable by transformers and pdserve, and the default model."""

from __future__ import annotations

import pytest


@pytest.mark.fast
def test_asset_paths():
    from pdserve import assets

    assert (assets.path("demo") / "config.json").is_file()
    with pytest.raises(ValueError, match="nope"):
        assets.path("nope")


def test_demo_loads_in_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve import assets

    d = assets.path("demo")
    model = AutoModelForCausalLM.from_pretrained(str(d))
    tok = AutoTokenizer.from_pretrained(str(d))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == "<s><|user|>hi\n"  # the newline closing a user turn is the assistant marker
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    assert model.config.vocab_size == len(tok)


@pytest.mark.fast
def test_demo_tokenizer_merges_recall_keys():
    """A recall question's last token and its key's list token are single tokens (`c?\\n`, `c=`)."""
    from transformers import AutoTokenizer

    from pdserve import assets

    tok = AutoTokenizer.from_pretrained(str(assets.path("demo")))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Remember: c=k0k, q=4xa. What is c?"}],
                                     add_generation_prompt=True, tokenize=False)
    pieces = tok.convert_ids_to_tokens(tok(prompt, add_special_tokens=False)["input_ids"])
    assert pieces[-1] == "c?\n" and "c=" in pieces and "q=" in pieces
    assert tok.convert_ids_to_tokens(tok("What is 2 + 3?\n", add_special_tokens=False)["input_ids"])[-2:] == [
        "3", "?\n"]
    ids = tok(prompt + "k0k", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == prompt.removeprefix("<s>").removeprefix("<|user|>") + "k0k"


def _load_trainer():
    """scripts/train_demo_model.py as a module (scripts/ is not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "train_demo_model.py"
    spec = importlib.util.spec_from_file_location("train_demo_model_under_test", script)
    trainer = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = trainer  # dataclasses resolve their module by name
    try:
        spec.loader.exec_module(trainer)
    finally:
        del sys.modules[spec.name]
    return trainer


@pytest.mark.fast
def test_trainer_encoding_matches_the_shipped_tokenizer():
    """scripts/train_demo_model.py trains on exactly the tokens the shipped template + tokenizer produce."""
    import random

    from transformers import AutoTokenizer

    from pdserve import assets

    trainer = _load_trainer()
    tok = AutoTokenizer.from_pretrained(str(assets.path("demo")))
    assert len(tok) == len(trainer.VOCAB)
    full = trainer.Curriculum(trainer.COPY_STEPS[-1], trainer.RECALL_STEPS[-1])
    for seed in range(20):
        conv = trainer.sample_conversation(random.Random(seed), full, 400, followup_prob=0.5)
        plain = [{"role": m["role"], "content": m["content"]} for m in conv]
        rendered = tok.apply_chat_template(plain, tokenize=False)
        assert tok(rendered, add_special_tokens=False)["input_ids"] == trainer.encode(conv)[0]


@pytest.mark.fast
def test_trainer_task_shares():
    """--recall-share / --copy-share set the task mix; without --copy-share arithmetic : copy keep their ratio."""
    import random
    from collections import Counter

    trainer = _load_trainer()

    def mix(**shares) -> dict[str, float]:
        cur = trainer.Curriculum(trainer.COPY_STEPS[-1], trainer.RECALL_STEPS[-1], **shares)
        rng = random.Random(0)
        counts = Counter(trainer.sample_turn(rng, cur).task for _ in range(4000))
        return {t: counts[t] / 4000 for t in ("arithmetic", "copy", "recall")}

    explicit = mix(recall_share=0.45, copy_share=0.1)
    assert abs(explicit["recall"] - 0.45) < 0.03 and abs(explicit["copy"] - 0.1) < 0.03
    assert abs(explicit["arithmetic"] - 0.45) < 0.03
    ratio = mix(recall_share=0.45)
    expected_copy = 0.55 * trainer.TASK_PROBS["copy"] / (trainer.TASK_PROBS["copy"] + trainer.TASK_PROBS["arithmetic"])
    assert abs(ratio["copy"] - expected_copy) < 0.03 and abs(ratio["recall"] - 0.45) < 0.03
    assert trainer.parse_args(["--copy-share", "0.1", "--recall-share", "0.45"]).copy_share == 0.1
    for bad in (["--copy-share", "0.6", "--recall-share", "0.45"], ["--copy-share", "-0.1"]):
        with pytest.raises(SystemExit):
            trainer.parse_args(bad)


@pytest.mark.fast
def test_trainer_lookup_targets_point_at_the_recalled_value():
    """Each recall answer character's target is the list token it copies; a follow-up uses the latest list."""
    trainer = _load_trainer()
    conv = [
        {"role": "user", "content": "Remember: a=x1y, c=k0k, b=z9q. What is c?"},
        {"role": "assistant", "content": "k0k", "task": "recall"},
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": "3 + 4 = 7", "task": "arithmetic"},
        {"role": "user", "content": "Remember: c=m2n, d=p3r. What is d?"},
        {"role": "assistant", "content": "p3r", "task": "recall"},
        {"role": "user", "content": "What is c?"},
        {"role": "assistant", "content": "m2n", "task": "recall"},
    ]
    ids, _, spans = trainer.encode(conv)
    targets = trainer.lookup_targets(ids, spans)
    assert len(targets) == 9  # three characters per recall answer, none for arithmetic or </s>
    answers = [c for m in conv if m.get("task") == "recall" for c in m["content"]]
    for (query, source), char in zip(targets, answers):
        assert ids[source] == trainer.CHAR_ID[char] and ids[query + 1] == trainer.CHAR_ID[char]
    # The follow-up "What is c?" copies the second list (c=m2n), not the first.
    assert targets[6][1] > spans[1][2]
    # Key heads: every value character of both lists looks at its own "k=", every answer character at "k?\n".
    keys = trainer.key_targets(ids, spans)
    key_eq = {trainer.CHAR_ID[k + "="] for k in "abcd"}
    assert len(keys) == 3 * 5 + 3 * 3
    for query, source in keys:
        assert ids[source] in key_eq | set(trainer.KEY_EQ) and 1 <= query - source <= 3


@pytest.mark.fast
def test_trainer_copy_operand_and_previous_token_targets():
    """Copy heads look at the character they emit; operand heads at A's and B's digits; a previous-token head one back."""
    trainer = _load_trainer()
    conv = [
        {"role": "user", "content": "Repeat: q7w2e9"},
        {"role": "assistant", "content": "q7w2e9", "task": "copy"},
        {"role": "user", "content": "What is 7 + 12?"},
        {"role": "assistant", "content": "7 + 12 = 19", "task": "arithmetic"},
        {"role": "user", "content": "Remember: a=x1y, c=k0k. What is c?"},
        {"role": "assistant", "content": "k0k", "task": "recall"},
        {"role": "user", "content": "What is 45 - 3?"},
        {"role": "assistant", "content": "45 - 3 = 42", "task": "arithmetic"},
    ]
    ids, _, spans = trainer.encode(conv)
    digits = {trainer.CHAR_ID[d] for d in "0123456789"}

    copies = trainer.copy_targets(ids, spans, ("copy", "arithmetic"))
    assert len(copies) == len("q7w2e9") + len("7 + 12") + len("45 - 3")  # not the result, not </s>, not recall
    for query, source in copies:
        assert source < query and ids[source] == ids[query + 1]  # the source is the token to emit next
    assert len(trainer.copy_targets(ids, spans, ("copy",))) == len("q7w2e9")

    heads = trainer.arith_targets(ids, spans)
    assert [len(h) for h in heads] == [3 + 3] * 5  # "19</s>" and "42</s>": two digits and the </s>
    char = {i: t for t, i in trainer.CHAR_ID.items()}
    first, second = slice(0, 3), slice(3, 6)
    assert {char[ids[k]] for _, k in heads[1][first]} == {"7"} and {char[ids[k]] for _, k in heads[1][second]} == {"5"}
    assert {char[ids[k]] for _, k in heads[0][second]} == {"4"}
    assert all(ids[k] not in digits for _, k in heads[0][first])  # one-digit A: its "tens" is no digit
    assert {char[ids[k]] for _, k in heads[2][first]} == {"1"} and {char[ids[k]] for _, k in heads[3][first]} == {"2"}
    assert all(ids[k] not in digits for _, k in heads[2][second]) and {char[ids[k]] for _, k in heads[3][second]} == {"3"}
    assert [char[ids[k]] for _, k in heads[4]] == ["+"] * 3 + ["-"] * 3
    queries = [q for q, _ in heads[0]]
    assert [char.get(ids[q + 1], "</s>") for q in queries] == ["1", "9", "</s>", "4", "2", "</s>"]
    assert all([q for q, _ in h] == queries for h in heads)

    # --decay-from moves the start of the LR decay; before it the LR stays at its peak.
    early = trainer.parse_args(["--decay-from", "0.6", "--total-steps", "1000"])
    assert trainer.lr_at(599, early) == early.lr and trainer.lr_at(800, early) < early.lr
    assert trainer.lr_at(799, trainer.parse_args(["--decay-from", "0.8", "--total-steps", "1000"])) == early.lr

    padded = ids + [trainer.PAD] * 5
    assert trainer.prev_targets(padded) == [(i, i - 1) for i in range(1, len(ids))]

    for bad in (["--lookup-attn-tasks", "recall,sums"], ["--lookup-attn-tasks", ""],
                ["--arith-attn-weight", "1", "--arith-attn-heads", "2,3"],
                ["--arith-attn-weight", "1", "--arith-attn-heads", "1,2,3,4,5,6"],
                ["--prev-attn-weight", "1", "--prev-attn-layer", "9"], ["--arith-attn-weight", "-0.5"],
                ["--decay-from", "0"], ["--decay-from", "1.5"], ["--eval-n", "2"],
                ["--decay-recall-share", "0.7", "--decay-copy-share", "0.4"], ["--decay-copy-share", "-0.1"]):
        with pytest.raises(SystemExit):
            trainer.parse_args(bad)


@pytest.mark.fast
def test_trainer_resume_keeps_the_checkpoints_recipe(tmp_path):
    """A resumed run is the same run: recipe flags come from the checkpoint, the rest from the command line."""
    trainer = _load_trainer()
    saved = vars(trainer.parse_args(["--recall-share", "0.4", "--copy-share", "0.2", "--arith-attn-heads",
                                     "2,3,4,5,6", "--threads", "1"]))
    # A checkpoint older than --decay-from decayed from 0.8, with no decay-phase shares.
    for newer in ("decay_from", "decay_recall_share", "decay_copy_share"):
        del saved[newer]
    args = trainer.parse_args(["--threads", "2", "--device", "cpu", "--max-minutes", "5"])
    logf = tmp_path / "train.log"
    trainer.restore_recipe(args, saved, logf)
    assert (args.recall_share, args.copy_share, args.arith_attn_heads) == (0.4, 0.2, "2,3,4,5,6")
    assert (args.decay_from, args.decay_recall_share, args.decay_copy_share) == (0.8, None, None)
    assert (args.threads, args.max_minutes) == (2, 5.0)  # not recipe: the command line wins
    said = logf.read_text()
    assert "--recall-share 0.3 (checkpoint: 0.4)" in said and "--decay-from 0.6 (checkpoint: 0.8)" in said
    assert "--threads" not in said

    # Nothing to say when the command line already is the checkpoint's recipe.
    quiet = tmp_path / "quiet.log"
    trainer.restore_recipe(trainer.parse_args([]), vars(trainer.parse_args([])), quiet)
    assert not quiet.exists()


def test_trainer_tiny_run_switches_shares_at_the_decay_resumes_and_exports(tmp_path):
    """A real (tiny) run: stopped by --max-minutes, resumed with its own recipe, decay-phase shares, export."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "train_demo_model.py"
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    tiny = ["--threads", "1", "--hidden", "32", "--intermediate", "64", "--layers", "4", "--heads", "8",
            "--kv-heads", "4", "--tokens-per-step", "512", "--short-row", "128", "--eval-every", "2",
            "--eval-n", "3", "--final-eval-n", "2", "--ckpt-dir", str(ckpt), "--out", str(out)]
    first = subprocess.run([sys.executable, str(script), *tiny, "--total-steps", "6", "--decay-from", "0.5",
                            "--max-minutes", "0.0001"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "--max-minutes reached at step 1" in first.stdout and not out.exists()

    # The resume names another recipe on its command line: the checkpoint's wins, and the log says so.
    second = subprocess.run([sys.executable, str(script), *tiny, "--resume", "--recall-share", "0.5"],
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    log = (ckpt / "train.log").read_text()
    assert "ignored: --total-steps 5000 (checkpoint: 6), --decay-from 0.6 (checkpoint: 0.5)" in log
    assert "--recall-share 0.5 (checkpoint: 0.3)" in log
    evals = [line for line in log.splitlines() if "eval step" in line]
    assert [line.split("eval step ")[1].split()[0] for line in evals] == ["2", "4", "6"]
    # Steps 0-2 use the main shares, steps from the decay start (step 3) the decay-phase ones.
    assert "recall_share=0.3, copy_share=0.15" in evals[0]
    assert "recall_share=0.2, copy_share=0.1" in evals[1] and "recall_share=0.2, copy_share=0.1" in evals[2]

    exported = json.loads((out / "config.json").read_text())
    assert exported["hidden_size"] == 32 and (out / "model.safetensors").exists()
    readme = (out / "README.md").read_text()
    assert "Trained for 6 steps" in readme and "--decay-from 0.5" in readme and "Status: below the bars" in readme


@pytest.mark.fast
def test_trainer_lookup_attention_matches_the_models_own_attention():
    """The recomputed supervised scores are the layer's real attention (eager attention as reference)."""
    import random

    import torch

    trainer = _load_trainer()
    torch.manual_seed(0)
    args = trainer.parse_args(["--hidden", "64", "--intermediate", "128", "--layers", "2", "--heads", "4",
                               "--kv-heads", "2", "--lookup-attn-weight", "1", "--lookup-attn-layer", "1",
                               "--lookup-attn-heads", "1,2", "--key-attn-weight", "0", "--prev-attn-weight", "0",
                               "--arith-attn-weight", "0"])
    model = trainer.build_model(trainer.build_config(args)).eval()
    lookup = trainer.SupervisedAttention(model, 1, [1, 2])
    cur = trainer.Curriculum(trainer.COPY_STEPS[-1], trainer.RECALL_STEPS[-1], recall_share=0.8)
    ids, _, spans = trainer.make_batch(random.Random(3), cur, 256, 1024, followup_prob=0.5)
    targets = [trainer.lookup_targets(ids[r].tolist(), row) for r, row in enumerate(spans)]
    assert sum(map(len, targets)) > 0
    with torch.no_grad():
        model(input_ids=ids)
        loss = lookup.loss(targets)
        model.config._attn_implementation = "eager"
        attn = model(input_ids=ids, output_attentions=True).attentions[1]
    reference = torch.stack([attn[r, [1, 2], q, k] for r, row in enumerate(targets) for q, k in row])
    assert torch.allclose(loss, -reference.log().mean(), rtol=1e-4)
    # Re-initialising a KV group's scores touches only its heads' query and key rows.
    before = {n: t.clone() for n, t in model.state_dict().items()}
    trainer.SupervisedAttention(model, 1, [2, 3]).reset_scores(torch.Generator().manual_seed(0))
    changed = {n for n, t in model.state_dict().items() if not torch.equal(t, before[n])}
    assert changed == {"model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"}
    q_rows = (model.model.layers[1].self_attn.q_proj.weight != before["model.layers.1.self_attn.q_proj.weight"]).any(1)
    assert q_rows.nonzero().flatten().tolist() == list(range(32, 64))  # heads 2 and 3 of head dim 16
    k_rows = (model.model.layers[1].self_attn.k_proj.weight != before["model.layers.1.self_attn.k_proj.weight"]).any(1)
    assert k_rows.nonzero().flatten().tolist() == list(range(16, 32))  # their KV head 1
    with pytest.raises(AssertionError, match="whole KV groups"):
        trainer.SupervisedAttention(model, 1, [1]).reset_scores(torch.Generator())
    # A continuation keeps trained key heads; its replay command says so in a form the parser takes back.
    kept = vars(trainer.parse_args(["--key-attn-weight", "1", "--no-key-attn-reset"]))
    command = trainer.reproduce_command(kept)
    assert "--no-key-attn-reset" in command
    assert trainer.parse_args(command.split()[2:]).key_attn_reset is False
    for bad in (["--lookup-attn-weight", "1", "--lookup-attn-layer", "4"], ["--key-attn-weight", "1",
                "--key-attn-heads", "8"], ["--lookup-attn-weight", "1", "--lookup-attn-heads", "a,b"],
                ["--key-attn-weight", "-1"]):
        with pytest.raises(SystemExit):
            trainer.parse_args(bad)


def test_engine_defaults_to_demo_and_copies(make_engine):
    from pdserve import assets

    engine = make_engine(assets.path("demo"))
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Repeat: abc123xyz"}],
                                                  add_generation_prompt=True, tokenize=False)
    out = engine.generate(input_ids=engine.tokenizer(prompt, add_special_tokens=False)["input_ids"],
                          sampling_params={"max_new_tokens": 40, "temperature": 0})
    assert out["text"] == "abc123xyz"
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def _target_config():
    import json

    from pdserve import assets

    return json.loads((assets.path("demo") / "config.json").read_text())


def test_eagle_head_has_the_eagle1_layout():
    import json

    from safetensors.torch import load_file

    from pdserve import assets

    d = assets.path("demo-eagle")
    cfg, tgt = json.loads((d / "config.json").read_text()), _target_config()
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"] and cfg["num_hidden_layers"] == 1
    h = tgt["hidden_size"]
    assert cfg["hidden_size"] == h and cfg["vocab_size"] == tgt["vocab_size"]
    w = load_file(str(d / "model.safetensors"))
    assert tuple(w["fc.weight"].shape) == (h, 2 * h)
    assert ("fc.bias" in w) == cfg.get("bias", True)
    assert tuple(w["layers.0.self_attn.q_proj.weight"].shape) == (cfg["num_attention_heads"] * cfg["head_dim"], h)
    assert "layers.0.input_layernorm.weight" not in w  # EAGLE-1 layer 0 has no input norm
    assert not any(k.startswith(("lm_head", "norm.")) for k in w)  # the target's head is shared


def test_eagle3_head_layout_and_d2t_maps_into_target_vocab():
    import json

    import torch
    from safetensors.torch import load_file

    from pdserve import assets

    d = assets.path("demo-eagle3")
    cfg, tgt = json.loads((d / "config.json").read_text()), _target_config()
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    h, vd, v = tgt["hidden_size"], cfg["draft_vocab_size"], tgt["vocab_size"]
    w = load_file(str(d / "model.safetensors"))
    assert tuple(w["fc.weight"].shape) == (h, 3 * h)
    assert w["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h  # cat(embed, hidden)
    assert tuple(w["lm_head.weight"].shape) == (vd, h) and vd < v
    for name in ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "norm.weight"):
        assert tuple(w[name].shape) == (h,)
    d2t, t2d = w["d2t"], w["t2d"]
    assert d2t.dtype == torch.int64 and tuple(d2t.shape) == (vd,)
    target_ids = torch.arange(vd) + d2t  # offsets, not absolute ids
    assert int(target_ids.min()) >= 0 and int(target_ids.max()) < v
    assert len(set(target_ids.tolist())) == vd
    assert t2d.dtype == torch.bool and t2d.nonzero().flatten().tolist() == sorted(target_ids.tolist())
    # Every token an answer can need is draftable: digits, lowercase, " + - =" and </s>.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(assets.path("demo")))
    needed = tok("0123456789abcdefghijklmnopqrstuvwxyz +-=", add_special_tokens=False)["input_ids"]
    assert set(needed + [tok.eos_token_id]) <= set(target_ids.tolist())
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert len(ids) == 3 and ids == sorted(set(ids)) and max(ids) < tgt["num_hidden_layers"] - 1


# A few fixed held-out questions (demo_tasks.is_heldout) the demo model answers exactly.
FIXED_QUESTIONS = [
    ("Remember: r=9xq, h=nob, v=1cw, a=2fp, g=m71. What is r?", "9xq"),
    ("Remember: l=qvd, a=quv, f=0fi, k=6wv, x=k5l. What is k?", "6wv"),
    ("Remember: y=t1n, t=gph, u=gd0, q=d65, m=qp3, a=5yi, b=nbf, v=x4h, k=tnx, e=4l0, d=fgh, z=yxu, s=svk, "
     "j=toy. What is a?", "5yi"),
    # Long lists where a value character also occurs in another value (the run-3 model,
    # copying on the previous character alone, answered both wrong).
    ("Remember: u=b27, q=jvx, p=lmx, f=ysm, n=8rh, z=7m2, e=q29, s=qhh, c=ewk, x=zir, l=26z, i=kgg, h=w4q, "
     "b=ugw, v=1it. What is p?", "lmx"),
    ("Remember: q=bb5, o=b7t, r=6d1, e=2uf, p=nmy, c=fwl, t=i18, v=njc, h=m4o, u=70z, a=jil, d=7tw. What is o?",
     "b7t"),
    ("What is 15 + 17?", "15 + 17 = 32"),
    ("What is 77 - 23?", "77 - 23 = 54"),
    ("What is 58 + 29?", "58 + 29 = 87"),
    ("Repeat: aotsqeiyk64dcul", "aotsqeiyk64dcul"),
    ("Repeat: wqdohn65amekyz397vt8", "wqdohn65amekyz397vt8"),
]


@pytest.mark.fast
def test_fixed_questions_are_held_out():
    from pdserve.assets import demo_tasks

    assert [demo_tasks.is_heldout(q) for q, _ in FIXED_QUESTIONS] == [True] * len(FIXED_QUESTIONS)


def test_demo_answers_fixed_questions_in_transformers_and_pdserve(make_engine):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve import assets

    d = assets.path("demo")
    tok = AutoTokenizer.from_pretrained(str(d))
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    engine = make_engine(d)
    for question, answer in FIXED_QUESTIONS:
        prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=len(answer) + 3, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        assert tok.decode(out[0, len(ids):], skip_special_tokens=True) == answer, question
        res = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": len(answer) + 3, "temperature": 0})
        assert res["text"] == answer, question
