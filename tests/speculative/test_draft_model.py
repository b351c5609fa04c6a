"""pdserve's EAGLE / EAGLE3 draft model reads the public checkpoint layouts exactly:
its outputs equal the independent reference (pdserve/speculative/reference.py, which
trains the demo heads), its target-feature capture follows the documented layer
convention, and bad checkpoints are refused with a message naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.config import ServerArgs
from pdserve.model.attention import ForwardContext, RowLayout, TorchNativeAttention
from pdserve.model.layers import RotaryEmbedding
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ModelRunner
from pdserve.scheduler.memory import ReqToTokenPool, TokenToKVPool
from pdserve.speculative.draft_model import DraftConfig, DraftConfigError, EagleDraftModel
from pdserve.speculative.reference import DraftHead, target_pass
from pdserve.testing import build_random_draft, build_random_model

pytestmark = pytest.mark.fast

T = 24


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("t4"), "llama", num_layers=4, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def runner(target_dir) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=str(target_dir), max_total_tokens=256), target_dir, TPGroup())


@pytest.fixture(scope="module")
def hf_target(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()


def _draft(tmp_path: Path, target_dir: Path, algo: str, **kw) -> Path:
    return build_random_draft(target_dir, tmp_path / algo, algo, **kw)


def _reference(hf_target, draft_dir: Path, algo: str) -> DraftHead:
    from safetensors.torch import load_file

    state = load_file(str(draft_dir / "model.safetensors"))
    vocab = None
    if algo == "EAGLE3":
        vocab = torch.arange(len(state["d2t"])) + state["d2t"]
    head = DraftHead(algo, hf_target.config, hf_target.model.embed_tokens.weight, hf_target.lm_head.weight, vocab)
    head.load_state_dict({k: v for k, v in state.items() if k not in ("d2t", "t2d")})
    return head.eval()


class DraftRun:
    """A draft model bound to a one-request draft KV pool."""

    def __init__(self, runner: ModelRunner, draft_dir: Path, algo: str) -> None:
        self.cfg = DraftConfig.from_dir(draft_dir, algo, runner.config)
        self.model = EagleDraftModel.load(draft_dir, self.cfg, runner.model.model.embed_tokens,
                                          runner.model.lm_head, runner.device, torch.float32)
        lay = self.cfg.layer
        self.pool = TokenToKVPool("draft", self.cfg.num_layers, 64, lay.num_kv_heads, lay.head_dim, torch.float32,
                                  runner.device)
        self.table = ReqToTokenPool(1, 64, runner.device)
        self.row = self.table.alloc()
        self.table.table[self.row, :63] = torch.arange(1, 64)
        self.model.bind(TorchNativeAttention(self.pool, lay.num_heads, lay.num_kv_heads, lay.head_dim),
                        RotaryEmbedding(lay.head_dim, 64, lay.rope))

    def run(self, ids: torch.Tensor, hidden: torch.Tensor, prefix: int, from_target: bool) -> torch.Tensor:
        ctx = ForwardContext.build(self.table.table, RowLayout.upload([self.row], [prefix], [len(ids)], ids.device))
        with torch.no_grad():
            return self.model(ids, hidden, ctx, from_target)


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_draft_matches_reference_extend_and_chain_step(tmp_path, target_dir, runner, hf_target, algo):
    draft_dir = _draft(tmp_path, target_dir, algo, draft_vocab_size=40)
    ref = _reference(hf_target, draft_dir, algo)
    run = DraftRun(runner, draft_dir, algo)
    ids = torch.randint(3, 90, (1, T + 2), generator=torch.Generator().manual_seed(1))
    aux = json.loads((draft_dir / "config.json").read_text()).get("eagle_config", {}).get(
        "eagle_aux_hidden_state_layer_ids", [0, 1, 2])
    tp = target_pass(hf_target, ids, aux)
    feats = tp["eagle"] if algo == "EAGLE" else tp["eagle3"]
    # Draft row p reads (x_{p+1}, f_p).
    tokens, f = ids[0, 1:], feats[0, :-1]
    with torch.no_grad():
        ref_steps = ref.ttt(tokens[None], f[None], depth=2)
    got = run.run(tokens[:T], f[:T], prefix=0, from_target=True)
    torch.testing.assert_close(got, ref_steps[0][0, :T], atol=2e-5, rtol=1e-4)
    logits = run.model.compute_logits(got)
    torch.testing.assert_close(logits, ref.logits(ref_steps[0][0, :T]).float(), atol=1e-4, rtol=1e-4)
    # One chain step: token x_{T+1} with the head's own output at T-1, at position T.
    step = run.run(tokens[T:T + 1], got[T - 1:T], prefix=T, from_target=False)
    torch.testing.assert_close(step[0], ref_steps[1][0, T - 1], atol=2e-5, rtol=1e-4)
    if algo == "EAGLE3":
        d2t_ids = run.model.draft_to_target
        assert d2t_ids is not None and torch.equal(d2t_ids, ref.draft_vocab)
        assert logits.shape[-1] == 40


def test_eagle3_capture_follows_sglang_layer_ids(tmp_path, target_dir, runner, hf_target):
    """eagle_aux_hidden_state_layer_ids [0, 1, 2] = outputs of layers 0..2 = inputs of layers 1..3."""
    draft_dir = _draft(tmp_path, target_dir, "EAGLE3")
    cfg = DraftConfig.from_dir(draft_dir, "EAGLE3", runner.config)
    assert cfg.capture_layers == (1, 2, 3) and cfg.feature_width == 3 * runner.config.hidden_size
    ids = torch.randint(3, 90, (1, 10), generator=torch.Generator().manual_seed(2))
    table = ReqToTokenPool(1, 64, runner.device)
    row = table.alloc()
    table.table[row, :10] = torch.arange(1, 11)
    runner.bind_memory(TokenToKVPool("target", 4, 64, 2, runner.config.head_dim, torch.float32, runner.device),
                       table.table, 64, table.padding_row)
    ctx = ForwardContext.build(table.table, RowLayout.upload([row], [0], [10], runner.device))
    with torch.no_grad():
        final, captured = runner.model(ids[0], ctx, cfg.capture_layers)
    ref = target_pass(hf_target, ids, [0, 1, 2])
    torch.testing.assert_close(torch.cat(captured, -1), ref["eagle3"][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, ref["eagle"][0], atol=1e-4, rtol=1e-4)
    # Without explicit ids: SGLang's default inputs of [2, L//2, L-3], in that order.
    raw = json.loads((draft_dir / "config.json").read_text())
    del raw["eagle_config"]
    (draft_dir / "config.json").write_text(json.dumps(raw))
    assert DraftConfig.from_dir(draft_dir, "EAGLE3", runner.config).capture_layers == (2, 2, 1)


def _edit_config(d: Path, **changes) -> None:
    raw = json.loads((d / "config.json").read_text())
    raw.update(changes)
    (d / "config.json").write_text(json.dumps(raw))


def test_bad_drafts_are_refused(tmp_path, target_dir, runner):
    from safetensors.torch import load_file, save_file

    eagle, eagle3 = _draft(tmp_path, target_dir, "EAGLE"), _draft(tmp_path, target_dir, "EAGLE3", draft_vocab_size=30)
    with pytest.raises(DraftConfigError, match="EAGLE3 draft"):
        DraftConfig.from_dir(eagle3, "EAGLE", runner.config)
    with pytest.raises(DraftConfigError, match="EAGLE draft"):
        DraftConfig.from_dir(eagle, "EAGLE3", runner.config)
    with pytest.raises(DraftConfigError, match="no config.json"):
        DraftConfig.from_dir(tmp_path, "EAGLE", runner.config)

    def load(d: Path, algo: str) -> None:
        cfg = DraftConfig.from_dir(d, algo, runner.config)
        EagleDraftModel.load(d, cfg, runner.model.model.embed_tokens, runner.model.lm_head, runner.device,
                             torch.float32)

    load(eagle, "EAGLE")
    load(eagle3, "EAGLE3")
    # d2t holding absolute ids instead of offsets: caught at load.
    state = load_file(str(eagle3 / "model.safetensors"))
    state["d2t"] = torch.arange(30) + state["d2t"] + 80
    save_file(state, str(eagle3 / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t"):
        load(eagle3, "EAGLE3")
    # A missing tensor is named.
    state = load_file(str(eagle / "model.safetensors"))
    del state["layers.0.mlp.down_proj.weight"]
    save_file(state, str(eagle / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj"):
        load(eagle, "EAGLE")
    # Another tokenizer / width.
    other = _draft(tmp_path / "o", target_dir, "EAGLE")
    _edit_config(other, vocab_size=runner.config.vocab_size + 1)
    with pytest.raises(DraftConfigError, match="vocab_size"):
        DraftConfig.from_dir(other, "EAGLE", runner.config)
    _edit_config(other, vocab_size=runner.config.vocab_size, hidden_size=32, head_dim=8)
    with pytest.raises(DraftConfigError, match="hidden_size"):
        DraftConfig.from_dir(other, "EAGLE", runner.config)
    _edit_config(eagle3, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 3]})
    with pytest.raises(DraftConfigError, match="target layers"):
        DraftConfig.from_dir(eagle3, "EAGLE3", runner.config)


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_loaded_draft_is_frozen(tmp_path, target_dir, runner, algo):
    """The draft's own parameters (EAGLE3's d2t included) and the target's it shares
    require no grad: the draft's CUDA graphs record its forwards."""
    run = DraftRun(runner, _draft(tmp_path, target_dir, algo, draft_vocab_size=40), algo)
    params = dict(run.model.named_parameters())
    shared = [p for m in run.model._shared for p in m.parameters()]
    assert params and shared
    assert [n for n, p in params.items() if p.requires_grad] == [] and not any(p.requires_grad for p in shared)
