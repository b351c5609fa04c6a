"""EAGLE and EAGLE3 draft heads, and a target's own MTP layer: what a checkpoint directory
says, checked against the target.

Split from ``draft_model.py`` along the line between *reading a checkpoint's config and
layout* and *the module that runs*: ``DraftConfig.from_dir`` reads ``config.json`` and
the checkpoint's tensor names only (an index or safetensors headers; no tensor is read),
so a server can refuse a wrong draft at startup, and say why, before anything is built.
``draft_model.py`` builds and runs the head from the ``DraftConfig`` made here.
``DraftConfig``, ``DraftConfigError`` and ``ALGORITHMS`` are also importable from
``pdserve.speculative.draft_model``.

EAGLE3 layouts read (one model, only names and config shapes differ):

  SGLang / EAGLE repo  ``architectures`` LlamaForCausalLMEagle3 (or
          LlamaForCausalLM); ``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
          ``d2t`` (``t2d`` ignored).
  vLLM    ``Eagle3LlamaForCausalLM``; the first layer may be ``layers.0.*``;
          extra layers ``layers.{i}.*``.
  speculators  ``"speculators_model_type": "eagle3"`` (``Eagle3Speculator`` /
          ``Eagle3DraftModel``): the layer config nested in
          ``transformer_layer_config``, ``draft_vocab_size``,
          ``target_hidden_size``, ``norm_before_residual`` at the top;
          ``layers.{i}.*``, ``embed_tokens``, ``fc`` (bias optional).
  Without ``d2t`` the draft vocabulary is the target's (no mapping); without
  ``lm_head`` the target's head is used (SGLang's ``load_lm_head_from_target``).
  The draft's embedding is the target's, shared, unless its width differs from
  the target's (``hidden_size != target_hidden_size``) or the speculators config
  says it was trained (``embed_requires_grad``): then the checkpoint's own
  ``embed_tokens`` is used.

MTP ("NextN", GLM-4.5's built-in draft): ``--speculative-algorithm EAGLE`` (or SGLang's
``NEXTN``) with a *target* checkpoint as the draft directory (what
``config_checks.default_draft_model_path`` picks without --speculative-draft-model-path,
as SGLang does) drafts with the checkpoint's first multi-token-prediction layer,
``model.layers.{num_hidden_layers}.*``: ``eh_proj`` (EAGLE's ``fc`` over
cat(enorm(embed), hnorm(feature))), ``enorm``, ``hnorm``, one decoder layer shaped as the
target's (its MLP a MoE block when the checkpoint stores ``mlp.gate``) and
``shared_head.norm``. Its ``embed_tokens`` and ``shared_head.head`` are copies of the
target's: the target's are used, shared (SGLang and vLLM's loaders do the same). The
feature is EAGLE's, the target's final normed hidden state: SGLang's and vLLM's targets
hand the MTP layer their post-norm output, which ``hnorm`` normalises again.

Target layers the features come from: ``eagle_config.eagle_aux_hidden_state_layer_ids``
follows SGLang (id i is the *output* of target layer i, the residual stream
entering layer i + 1); a top-level ``eagle_aux_hidden_state_layer_ids`` (vLLM,
speculators) follows vLLM (id i is the residual stream *entering* layer i).
Without either the capture set is the residual stream entering layers
[2, L//2, L-3] (SGLang's and vLLM's default).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from safetensors import safe_open

from pdserve.model.loader import checkpoint_files, iter_checkpoint
from pdserve.model.model_config import Fp8Config, ModelConfig, ModelConfigError
from pdserve.model.registry import architecture_class, supported_architectures

ALGORITHMS = ("EAGLE", "EAGLE3")
# The draft layouts a DraftConfig names (``layout``); "mtp": the target's own NextN layer.
MTP_LAYOUT = "mtp"
_ARCHITECTURES = {
    "EAGLE": ("LlamaForCausalLMEagle", "LlamaForCausalLM"),
    "EAGLE3": ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM"),
}
# Names only an EAGLE3 head carries (a plain LlamaForCausalLM may be either).
_EAGLE3_ONLY = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator", "Eagle3DraftModel")
_SPECULATORS_ARCHITECTURES = ("Eagle3Speculator", "Eagle3DraftModel")


class DraftConfigError(ValueError):
    pass


@dataclass(frozen=True)
class DraftConfig:
    algorithm: str
    layer: ModelConfig              # the draft layers' dimensions (num_layers of them)
    fc_bias: bool
    draft_vocab_size: int           # == target vocab for EAGLE and for EAGLE3 heads without d2t
    capture_layers: tuple[int, ...]  # EAGLE3: target layers whose *input* residual is captured
    target_hidden_size: int = 0     # width of each captured target layer (0: the draft's hidden size)
    norm_before_residual: bool = False  # EAGLE3: the first layer's residual is hidden_norm(hidden)
    own_embed: bool = False         # the checkpoint's embed_tokens, not the target's
    own_head: bool = True           # EAGLE3: the checkpoint's lm_head (else the target's)
    has_d2t: bool = True            # EAGLE3: a d2t map (else draft ids are target ids)
    layout: str = "sglang"          # eagle | sglang (also vLLM's names) | speculators | mtp
    # MTP: the checkpoint prefix of the NextN layer drafted with (model.layers.{num_hidden_layers}.).
    mtp_prefix: str = ""

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def num_layers(self) -> int:
        return self.layer.num_layers

    @property
    def is_mtp(self) -> bool:
        return self.layout == MTP_LAYOUT

    @property
    def quant(self) -> Fp8Config | None:
        """The FP8 layout of the draft's stored weights, read by the loader (an MTP layer is
        quantised as its target is; EAGLE heads ship float weights)."""
        return self.layer.quant if self.is_mtp else None

    @property
    def feature_width(self) -> int:
        """Width of the per-position target feature the draft reads (what disaggregation moves)."""
        if self.algorithm == "EAGLE3":
            return 3 * (self.target_hidden_size or self.hidden_size)
        return self.hidden_size

    @classmethod
    def from_dir(cls, draft_dir: str | Path, algorithm: str, target: ModelConfig) -> "DraftConfig":
        draft_dir = Path(draft_dir)
        if algorithm not in ALGORITHMS:
            raise DraftConfigError(f"--speculative-algorithm must be one of {', '.join(ALGORITHMS)}, "
                                   f"got {algorithm!r}")
        path = draft_dir / "config.json"
        if not path.is_file():
            raise DraftConfigError(f"--speculative-draft-model-path {draft_dir}: no config.json")
        raw: dict[str, Any] = json.loads(path.read_text())
        archs = raw.get("architectures") or []
        if _nextn_count(raw):  # a target checkpoint (EAGLE heads have no NextN layers)
            return cls._mtp(draft_dir, raw, algorithm, target)
        speculators = "speculators_model_type" in raw or "transformer_layer_config" in raw or any(
            a in _SPECULATORS_ARCHITECTURES for a in archs)
        if algorithm == "EAGLE":
            if any(a in _EAGLE3_ONLY for a in archs) or raw.get("speculators_model_type") == "eagle3":
                raise DraftConfigError(f"{draft_dir} is an EAGLE3 draft ({archs}) but --speculative-algorithm "
                                       "is EAGLE")
            if speculators:
                raise DraftConfigError(f"{draft_dir}: speculators_model_type "
                                       f"{raw.get('speculators_model_type')!r}: EAGLE heads load from the "
                                       "EAGLE / SGLang layout only")
            if not any(a in _ARCHITECTURES["EAGLE"] for a in archs):
                raise DraftConfigError(f"{draft_dir}: architectures {archs} is not an EAGLE draft "
                                       f"(expected one of {', '.join(_ARCHITECTURES['EAGLE'])})")
            return cls._eagle(draft_dir, raw, target)
        if _ARCHITECTURES["EAGLE"][0] in archs:
            raise DraftConfigError(f"{draft_dir} is an EAGLE draft ({archs}) but --speculative-algorithm is EAGLE3")
        if speculators:
            raw = _flatten_speculators(draft_dir, raw)
        elif not any(a in _ARCHITECTURES["EAGLE3"] for a in archs):
            raise DraftConfigError(
                f"{draft_dir}: architectures {archs} is not an EAGLE3 draft (expected one of "
                f"{', '.join(_ARCHITECTURES['EAGLE3'] + _SPECULATORS_ARCHITECTURES)})")
        return cls._eagle3(draft_dir, raw, target, "speculators" if speculators else "sglang")

    @classmethod
    def _eagle(cls, draft_dir: Path, raw: dict[str, Any], target: ModelConfig) -> "DraftConfig":
        if int(raw.get("num_hidden_layers", 1)) != 1:
            raise DraftConfigError(f"{draft_dir}: num_hidden_layers {raw['num_hidden_layers']}: EAGLE heads "
                                   "have one layer (multi-layer drafts are EAGLE3 only)")
        layer = _layer_config(draft_dir, raw)
        h = layer.hidden_size
        target_hidden = int(raw.get("target_hidden_size") or h)
        if h != target.hidden_size or target_hidden != target.hidden_size:
            raise DraftConfigError(
                f"{draft_dir}: draft hidden_size {h} (target_hidden_size {target_hidden}) differs from the "
                f"target's {target.hidden_size}; EAGLE heads of another width are not supported "
                "(EAGLE3 heads may differ)")
        _check_vocab(draft_dir, layer, target)
        return cls("EAGLE", layer, bool(raw.get("bias", True)), target.vocab_size, (), layout="eagle")

    @classmethod
    def _mtp(cls, draft_dir: Path, raw: dict[str, Any], algorithm: str, target: ModelConfig) -> "DraftConfig":
        """A target checkpoint as the draft: its first NextN layer (see the module docstring)."""
        if algorithm != "EAGLE":
            raise DraftConfigError(f"{draft_dir} is a target checkpoint with multi-token-prediction (NextN) "
                                   f"layers; they draft with --speculative-algorithm EAGLE (or NEXTN), not "
                                   f"{algorithm}")
        try:
            own = ModelConfig.from_hf(raw)
        except (ModelConfigError, KeyError) as exc:
            raise DraftConfigError(f"{draft_dir}: {exc}") from None
        if own.nextn_layers == 0:
            raise DraftConfigError(
                f"{draft_dir}: num_nextn_predict_layers = {_nextn_count(raw)}, but pdserve drafts with NextN "
                f"layers only for {', '.join(mtp_architectures())}, not {own.architecture}")
        if own.nextn_layers != 1:
            raise DraftConfigError(f"{draft_dir}: num_nextn_predict_layers = {own.nextn_layers}: MTP drafts with "
                                   "one NextN layer (GLM-4.5 and DeepSeek-V3 ship one), as SGLang's")
        for name in ("architecture", "hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(own, name) != getattr(target, name):
                raise DraftConfigError(f"{draft_dir}: {name} {getattr(own, name)} differs from the target's "
                                       f"{getattr(target, name)}: an MTP layer drafts for its own model")
        prefix = f"model.layers.{own.num_layers}."
        names = {n[len(prefix):] for n in _tensor_names(draft_dir) if n.startswith(prefix)}
        missing = [n for n in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                               "self_attn.o_proj.weight") if n not in names]
        if missing:
            raise DraftConfigError(f"{draft_dir}: num_nextn_predict_layers = 1 but the checkpoint lacks the NextN "
                                   f"layer's {', '.join(prefix + n for n in missing)}")
        # One decoder layer at draft layer 0, shaped as the target's; its MLP is the MoE
        # block when the checkpoint stores a router for it (GLM-4.5's NextN layer is sparse).
        sparse = (0,) if "mlp.gate.weight" in names else ()
        moe = replace(own.moe, sparse_layers=sparse) if own.moe is not None else None
        layer = replace(own, num_layers=1, moe=moe, nextn_layers=0)
        return cls("EAGLE", layer, False, target.vocab_size, (), own_embed=False, own_head=False, has_d2t=False,
                   layout=MTP_LAYOUT, mtp_prefix=prefix)

    @classmethod
    def _eagle3(cls, draft_dir: Path, raw: dict[str, Any], target: ModelConfig, layout: str) -> "DraftConfig":
        layer = _layer_config(draft_dir, raw)
        _check_vocab(draft_dir, layer, target)
        if layer.num_layers < 1:
            raise DraftConfigError(f"{draft_dir}: num_hidden_layers {layer.num_layers} must be at least 1")
        eagle_config = raw.get("eagle_config") or {}
        if eagle_config.get("use_aux_hidden_state", True) is False:
            raise DraftConfigError(f"{draft_dir}: eagle_config.use_aux_hidden_state false (a head reading only "
                                   "the target's last hidden state) is not supported")
        if raw.get("tie_word_embeddings"):
            raise DraftConfigError(f"{draft_dir}: tie_word_embeddings true (an EAGLE3 head whose lm_head is its "
                                   "embedding) is not supported")
        names = _tensor_names(draft_dir)
        if any(n.startswith("additional_layers.") for n in names):
            raise DraftConfigError(
                f"{draft_dir}: tensors additional_layers.*: SGLang's extra-layer layout (its extra layers read "
                "hidden_norm as input norm) is not supported; multi-layer EAGLE3 heads load in the vLLM / "
                "speculators layout (layers.{i}.*)")
        h, v = layer.hidden_size, target.vocab_size
        target_hidden = int(raw.get("target_hidden_size") or target.hidden_size)
        if target_hidden != target.hidden_size:
            raise DraftConfigError(f"{draft_dir}: target_hidden_size {target_hidden} differs from the target's "
                                   f"hidden_size {target.hidden_size} (a draft for another model?)")
        has_d2t = "d2t" in names
        own_head = "lm_head.weight" in names
        vd = int(raw.get("draft_vocab_size") or v)
        if not 0 < vd <= v:
            raise DraftConfigError(f"{draft_dir}: draft_vocab_size {vd} must be in [1, {v}]")
        if not has_d2t and vd != v:
            raise DraftConfigError(f"{draft_dir}: draft_vocab_size {vd} is smaller than the target vocabulary "
                                   f"{v} but the checkpoint has no d2t (the draft-to-target id map)")
        if not own_head:
            if vd != v:
                raise DraftConfigError(f"{draft_dir}: no lm_head.weight but draft_vocab_size {vd}: a head "
                                       f"without its own lm_head uses the target's, over all {v} tokens")
            if h != target.hidden_size:
                raise DraftConfigError(f"{draft_dir}: no lm_head.weight and hidden_size {h} differs from the "
                                       f"target's {target.hidden_size}: the target's lm_head cannot be shared")
        own_embed = h != target.hidden_size or bool(raw.get("embed_requires_grad", False))
        if own_embed and "embed_tokens.weight" not in names:
            why = (f"hidden_size {h} differs from the target's {target.hidden_size}" if h != target.hidden_size
                   else "embed_requires_grad is true")
            raise DraftConfigError(f"{draft_dir}: {why}, so the head needs its own embed_tokens.weight, which "
                                   "the checkpoint lacks")
        return cls("EAGLE3", layer, "fc.bias" in names, vd, _capture_layers(draft_dir, raw, target),
                   target_hidden_size=target_hidden, norm_before_residual=bool(raw.get("norm_before_residual")),
                   own_embed=own_embed, own_head=own_head, has_d2t=has_d2t, layout=layout)


def _nextn_count(raw: dict[str, Any]) -> int:
    value = raw.get("num_nextn_predict_layers")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def mtp_architectures() -> tuple[str, ...]:
    """The registered architectures whose checkpoints' NextN layers pdserve drafts with."""
    return tuple(a for a in supported_architectures() if architecture_class(a).nextn_layers_key is not None)


def _layer_config(draft_dir: Path, raw: dict[str, Any]) -> ModelConfig:
    try:
        return ModelConfig.from_hf({"num_hidden_layers": 1, **raw, "architectures": ["LlamaForCausalLM"]})
    except (ModelConfigError, KeyError) as exc:
        raise DraftConfigError(f"{draft_dir}: {exc}") from None


def _check_vocab(draft_dir: Path, layer: ModelConfig, target: ModelConfig) -> None:
    if layer.vocab_size != target.vocab_size:
        raise DraftConfigError(f"{draft_dir}: vocab_size {layer.vocab_size} differs from the target's "
                               f"{target.vocab_size} (a draft for another tokenizer?)")


def _flatten_speculators(draft_dir: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """A speculators-library config as one flat dict in the SGLang layout's terms:
    the nested ``transformer_layer_config`` plus the EAGLE3 fields around it."""
    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        raise DraftConfigError(f"{draft_dir}: speculators_model_type {kind!r}: only 'eagle3' speculators "
                               "checkpoints are supported")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DraftConfigError(f"{draft_dir}: speculators config without a transformer_layer_config object")
    model_type = layer.get("model_type", "llama")
    if model_type != "llama":
        raise DraftConfigError(f"{draft_dir}: transformer_layer_config.model_type {model_type!r}: only Llama "
                               "draft layers are supported")
    if raw.get("norm_before_fc"):
        raise DraftConfigError(f"{draft_dir}: norm_before_fc true (an RMSNorm over the target features before "
                               "fc) is not supported")
    flat = {k: v for k, v in layer.items() if k not in ("architectures", "eagle_config")}
    # The speculators library's defaults where a field is absent.
    flat.update(draft_vocab_size=raw.get("draft_vocab_size", 32000),
                target_hidden_size=raw.get("target_hidden_size"),
                norm_before_residual=bool(raw.get("norm_before_residual", False)),
                embed_requires_grad=bool(raw.get("embed_requires_grad", False)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", layer.get("tie_word_embeddings", False))))
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        flat["eagle_aux_hidden_state_layer_ids"] = raw["eagle_aux_hidden_state_layer_ids"]
    return flat


def _capture_layers(draft_dir: Path, raw: dict[str, Any], target: ModelConfig) -> tuple[int, ...]:
    n = target.num_layers
    sglang_ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vllm_ids = raw.get("eagle_aux_hidden_state_layer_ids")
    for field, ids in (("eagle_config.eagle_aux_hidden_state_layer_ids", sglang_ids),
                       ("eagle_aux_hidden_state_layer_ids", vllm_ids)):
        if ids is not None and (len(ids) != 3 or any(not isinstance(i, int) for i in ids)):
            raise DraftConfigError(f"{draft_dir}: {field} must be 3 integers, got {ids!r}")
    if sglang_ids is not None:
        capture = tuple(i + 1 for i in sglang_ids)  # "output of layer i" = input of layer i + 1
        if vllm_ids is not None and tuple(vllm_ids) != capture:
            raise DraftConfigError(
                f"{draft_dir}: eagle_config.eagle_aux_hidden_state_layer_ids {list(sglang_ids)} (outputs of "
                f"those layers) and eagle_aux_hidden_state_layer_ids {list(vllm_ids)} (inputs of those layers) "
                "name different target layers")
    elif vllm_ids is not None:
        capture = tuple(vllm_ids)
    else:
        capture = (2, n // 2, n - 3)
    if any(not 1 <= c < n for c in capture):
        raise DraftConfigError(f"{draft_dir}: EAGLE3 reads the inputs of target layers {list(capture)}, "
                               f"which must lie in [1, {n - 1}] for a {n}-layer target")
    return capture


def _tensor_names(model_dir: Path) -> set[str]:
    """The checkpoint's tensor names, without reading any tensor where the format
    allows (a sharded checkpoint's index, safetensors headers)."""
    files = checkpoint_files(model_dir)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = model_dir / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
            if {model_dir / f for f in weight_map.values()} == set(files):
                return set(weight_map)
    if all(f.suffix == ".safetensors" for f in files):
        names: set[str] = set()
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                names.update(handle.keys())
        return names
    return {name for name, _ in iter_checkpoint(model_dir)}


# Bytes read from each end of each weight file for the fingerprint: enough to tell two
# trained heads apart without reading gigabytes at startup.
_FINGERPRINT_BYTES = 1 << 16


def draft_identity(draft_dir: str | Path, algorithm: str, layout: str = "") -> str:
    """A fingerprint of a draft checkpoint (algorithm, layout, config, each weight file's
    name, size and first and last bytes). Prefill and decode compare theirs: equal, decode
    may start from the draft state prefill computed. A collision would cost acceptance
    only, never output: every drafted token is verified by the target. An MTP draft's
    directory is the target checkpoint: "MTP" in the hash keeps it apart from that
    checkpoint used any other way, and two servers of the same model agree."""
    h = hashlib.sha256(algorithm.encode())
    if layout == MTP_LAYOUT:
        h.update(b"/MTP")
    draft_dir = Path(draft_dir)
    h.update((draft_dir / "config.json").read_bytes())
    for path in sorted(checkpoint_files(draft_dir)):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(_FINGERPRINT_BYTES))
            f.seek(max(0, size - _FINGERPRINT_BYTES))
            h.update(f.read(_FINGERPRINT_BYTES))
    return h.hexdigest()[:32]
