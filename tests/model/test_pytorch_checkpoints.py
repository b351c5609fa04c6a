"""PyTorch `pytorch_model.bin` checkpoints (single file, and sharded with
`pytorch_model.bin.index.json`): the same weights saved as .bin give the safetensors
checkpoint's greedy tokens, for a target and for EAGLE / EAGLE3 draft heads;
safetensors win when a directory has both; a pickle that holds anything but tensors
is refused, naming the file, without running it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdserve.model.loader import WeightLoadError, checkpoint_files, load_torch_checkpoint
from pdserve.testing import build_random_draft, build_random_model

pytestmark = pytest.mark.fast

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPTS = [[5, 6, 7], [9, 30, 31, 32, 33, 40, 41], [12] * 20]


class WritesMarker:
    """Unpickling this creates `marker` (pickle calls open(marker, "w")): what a
    malicious checkpoint could do, harmlessly visible."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[override]
        return (open, (str(self.marker), "w"))


def safetensors_state(model_dir: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def as_pytorch_bin(src: Path, dst: Path, shards: int = 1, legacy: bool = False) -> Path:
    """`src` with its safetensors weights re-saved as pytorch_model.bin (``shards`` > 1:
    pytorch_model-0000i-of-0000n.bin files, tensors interleaved, and the index)."""
    shutil.copytree(src, dst)
    state = safetensors_state(dst)
    for f in list(dst.glob("*.safetensors")) + list(dst.glob("*.safetensors.index.json")):
        f.unlink()
    kw = {"_use_new_zipfile_serialization": False} if legacy else {}
    if shards == 1:
        torch.save(state, dst / "pytorch_model.bin", **kw)
        return dst
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = names[i::shards]
        torch.save({n: state[n] for n in part}, dst / fname, **kw)
        weight_map.update({n: fname for n in part})
    (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("bin") / "llama", "llama", num_layers=2, num_heads=4,
                              num_kv_heads=2, hidden_size=64, seed=5)


@pytest.fixture(scope="module")
def reference(target) -> list[list[int]]:
    from pdserve import Engine

    with Engine(model_path=target, max_total_tokens=4096) as engine:
        return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def greedy(make_engine, model_dir: Path, **kw) -> list[list[int]]:
    return [o["output_ids"] for o in make_engine(model_dir, **kw).generate(input_ids=PROMPTS,
                                                                           sampling_params=GREEDY)]


# ---- loading ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shards,legacy", [(1, False), (2, False), (3, False), (1, True)],
                         ids=["single", "two-shards", "three-shards", "legacy-format"])
def test_bin_checkpoint_gives_the_safetensors_tokens(target, reference, make_engine, tmp_path, shards, legacy):
    d = as_pytorch_bin(target, tmp_path / "bin", shards, legacy)
    assert not list(d.glob("*.safetensors"))
    files = checkpoint_files(d)
    assert len(files) == shards and all(f.suffix == ".bin" for f in files)
    tokens = greedy(make_engine, d)
    assert all(len(t) == GREEDY["max_new_tokens"] for t in tokens)
    assert tokens == reference


def test_bin_weights_are_the_safetensors_weights(target, tmp_path):
    """Every tensor, bit for bit (the tokens above could hide a small difference)."""
    d = as_pytorch_bin(target, tmp_path / "bin", 2)
    loaded = {}
    for f in checkpoint_files(d):
        loaded.update(load_torch_checkpoint(f))
    want = safetensors_state(target)
    assert sorted(loaded) == sorted(want)
    assert all(torch.equal(loaded[n], want[n]) and loaded[n].dtype == want[n].dtype for n in want)


def test_safetensors_preferred_over_bin(target, reference, make_engine, tmp_path):
    """Both formats in one directory (as on many hub repos): the safetensors load; the .bin,
    here a pickle that would run code, is never opened."""
    d = tmp_path / "both"
    shutil.copytree(target, d)
    marker = tmp_path / "ran"
    torch.save({"model.embed_tokens.weight": WritesMarker(marker)}, d / "pytorch_model.bin")
    assert all(f.suffix == ".safetensors" for f in checkpoint_files(d))
    assert greedy(make_engine, d) == reference
    assert not marker.exists()


def test_sharded_bin_index_wins_over_a_stray_single_file(target, reference, make_engine, tmp_path):
    d = as_pytorch_bin(target, tmp_path / "bin", 2)
    torch.save({"junk": torch.zeros(1)}, d / "pytorch_model.bin")
    assert [f.name for f in checkpoint_files(d)] == ["pytorch_model-00001-of-00002.bin",
                                                      "pytorch_model-00002-of-00002.bin"]
    assert greedy(make_engine, d) == reference


# ---- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shards", [1, 2])
def test_malicious_pickle_is_refused_naming_the_file(target, tmp_path, shards):
    from pdserve import Engine

    d = as_pytorch_bin(target, tmp_path / "evil", shards)
    bad = checkpoint_files(d)[-1]
    state = torch.load(bad, weights_only=True)
    marker = tmp_path / "ran"
    state["model.norm.weight"] = WritesMarker(marker)  # type: ignore[assignment]
    torch.save(state, bad)
    with pytest.raises(WeightLoadError) as exc:
        Engine(model_path=d, max_total_tokens=4096)
    msg = str(exc.value)
    assert str(bad) in msg and "refused" in msg and "weights_only" in msg, msg
    assert "open" in msg, msg  # the global it tried to call is named
    assert not marker.exists(), "the checkpoint's pickle ran"


def test_not_a_state_dict_is_refused(target, tmp_path):
    d = as_pytorch_bin(target, tmp_path / "list", 1)
    torch.save(list(safetensors_state(target).values()), d / "pytorch_model.bin")
    with pytest.raises(WeightLoadError, match="state dict of named tensors"):
        load_torch_checkpoint(d / "pytorch_model.bin")


def test_missing_bin_shard_and_escaping_index_are_refused(target, tmp_path):
    d = as_pytorch_bin(target, tmp_path / "missing", 2)
    (d / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(WeightLoadError, match="pytorch_model-00002-of-00002.bin"):
        checkpoint_files(d)
    d = as_pytorch_bin(target, tmp_path / "escape", 2)
    index = json.loads((d / "pytorch_model.bin.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "../elsewhere/pytorch_model.bin"
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightLoadError, match="files of the checkpoint directory"):
        checkpoint_files(d)


def test_no_checkpoint_names_both_formats(target, tmp_path):
    d = tmp_path / "empty"
    shutil.copytree(target, d, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(WeightLoadError) as exc:
        checkpoint_files(d)
    assert "safetensors" in str(exc.value) and "pytorch_model.bin" in str(exc.value)


# ---- draft heads ------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm,shards", [("EAGLE", 1), ("EAGLE3", 1), ("EAGLE3", 2)])
def test_draft_head_as_bin_gives_the_same_speculative_output(target, reference, make_engine, tmp_path,
                                                             algorithm, shards):
    """A draft head shipped as pytorch_model.bin (as many public EAGLE heads are) loads
    through the same path: speculative output equal to plain decoding, and the very
    acceptance counts of the same head as safetensors (so the weights are the same)."""
    extra = {"draft_vocab_size": 60} if algorithm == "EAGLE3" else {}
    st_draft = build_random_draft(target, tmp_path / "draft", algorithm, seed=3, **extra)
    bin_draft = as_pytorch_bin(st_draft, tmp_path / "draft-bin", shards)
    assert all(f.suffix == ".bin" for f in checkpoint_files(bin_draft))
    spec = dict(speculative_algorithm=algorithm, speculative_num_steps=3, speculative_eagle_topk=2,
                speculative_num_draft_tokens=5)
    runs = {}
    for name, draft in (("safetensors", st_draft), ("bin", bin_draft)):
        outs = make_engine(target, speculative_draft_model_path=draft, **spec).generate(
            input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == reference, name
        runs[name] = [(o["meta_info"]["spec_verify_ct"], o["meta_info"]["spec_accepted_drafts"]) for o in outs]
    assert runs["bin"] == runs["safetensors"]
