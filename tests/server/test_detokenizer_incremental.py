"""Issue 39, finding 6: the detokenizer decodes a bounded window per update (not the whole
output) and checks stop-string prefixes in time linear in the new text.

- Same deltas, update by update, as the previous full-decode detokenizer (kept below as
  `FullDecode`, the reference) on the demo and character tokenizers, stop strings included.
- The streamed text equals the full decode (stop-trimmed) on random token streams of
  tokenizers with multi-byte characters: a byte-level BPE (random ids: invalid UTF-8 too)
  and a SentencePiece-style byte-fallback one, in updates of 1 to 40 tokens.
- Stop strings across update boundaries; the first occurrence is where the text is cut.
- The cost of one more token does not grow with the output: the state stays bounded and
  the per-token time at 64k tokens is within a few times the time at 1k.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import pytest

from pdserve import assets
from pdserve.sampling_params import SamplingParams
from pdserve.server.detokenizer import Detokenizer, IncrementalDecoder, StopScan, held_back
from pdserve.server.messages import TokenUpdate
from pdserve.testing import build_char_tokenizer
from pdserve.tokenizer import load_tokenizer, trim_at_stop

pytestmark = pytest.mark.fast


# ---- the reference: the detokenizer before issue 39 (whole output decoded per update) ------
class FullDecode:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.samples: dict[tuple[str, int], list[Any]] = {}

    @staticmethod
    def held_back(text: str, stops: tuple[str, ...]) -> int:
        hold = len(text) - len(text.rstrip("\ufffd")) if text.endswith("\ufffd") else 0
        for stop in stops:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        return hold

    def process(self, u: TokenUpdate) -> str:
        key = (u.rid, u.index)
        if key not in self.samples:
            self.samples[key] = [u.params or SamplingParams(), [], 0]
        sample = self.samples[key]
        p, ids = sample[0], sample[1]
        ids.extend(u.new_ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
        if u.finish is not None:
            matched = u.finish.get("matched")
            del self.samples[key]
            return trim_at_stop(text, matched if isinstance(matched, str) else None, p.no_stop_trim)[sample[2]:]
        stable = len(text) - self.held_back(text, p.stop)
        delta = text[sample[2]:stable] if stable > sample[2] else ""
        sample[2] = max(sample[2], stable)
        return delta


# ---- tokenizers -----------------------------------------------------------------------------
CORPUS = ["héllo wörld ünïcode ßtraße", "日本語のテキストと中文文本", "emoji 😀🎉👍🏽 mixed ascii text",
          "Ελληνικά και русский язык", "the quick brown fox jumps over the lazy dog 12345"] * 20
MULTIBYTE = "ab 日本語😀éß\n"


def byte_level_bpe() -> Any:
    """GPT-2 / Llama 3 / Qwen style: bytes mapped to characters, merged; random ids give
    invalid UTF-8 too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def byte_fallback_bpe() -> Any:
    """Llama 2 / Mistral style: `▁` for spaces (the first one stripped), unknown characters
    as <0xXX> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "a", "b", "▁a", "▁b", "ab", "\n"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁", "b"), ("a", "b")], byte_fallback=True,
                               unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    char_dir = tmp_path_factory.mktemp("chars")
    build_char_tokenizer(Path(char_dir))
    return {"demo": load_tokenizer(assets.path("demo")), "chars": load_tokenizer(char_dir),
            "byte_level": byte_level_bpe(), "byte_fallback": byte_fallback_bpe()}


# ---- helpers --------------------------------------------------------------------------------
def update(ids: Sequence[int], params: SamplingParams | None = None, finish: dict[str, Any] | None = None,
           rid: str = "r") -> TokenUpdate:
    return TokenUpdate(rid=rid, index=0, new_ids=tuple(ids), new_logprobs=(), new_top_logprobs=(), finish=finish,
                       prompt_tokens=1, cached_tokens=0, completion_tokens=0, retractions=0, spec_verify_ct=0,
                       spec_accepted_drafts=0, params=params)


def stream(detok: Any, ids: list[int], params: SamplingParams, finish: dict[str, Any], sizes: list[int],
           rng: random.Random) -> list[str]:
    """The deltas of `ids` sent in updates of random sizes, the finish on the last."""
    deltas, i, first = [], 0, True
    while True:
        k = rng.choice(sizes)
        chunk, i = ids[i:i + k], i + k
        last = i >= len(ids)
        out = detok.process(update(chunk, params if first else None, finish if last else None))
        deltas.append(out if isinstance(out, str) else out.text_delta)
        first = False
        if last:
            return deltas


def stopped(tok: Any, ids: list[int], rng: random.Random) -> tuple[list[int], SamplingParams, dict[str, Any]]:
    """A stop string taken from the text (and one that never occurs), and the output cut
    where the scheduler would stop it: at the first token whose text so far holds it."""
    full = tok.decode(ids, skip_special_tokens=True)
    if len(full) < 3:
        return ids, SamplingParams(), {"type": "length"}
    at = rng.randrange(len(full) - 1)
    stop = full[at:at + rng.randint(1, 4)]
    params = SamplingParams(stop=(stop, "\x00never"))
    end = next(j for j in range(1, len(ids) + 1) if stop in tok.decode(ids[:j], skip_special_tokens=True))
    return ids[:end], params, {"type": "stop", "matched": stop}


def random_ids(tok: Any, rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(len(tok)) for _ in range(n)]


# ---- the same deltas as before -------------------------------------------------------------
@pytest.mark.parametrize("name", ["demo", "chars"])
def test_same_deltas_update_by_update_as_the_full_decode(tokenizers, name):
    tok = tokenizers[name]
    rng = random.Random(39)
    for trial in range(150):
        ids = random_ids(tok, rng, rng.randint(0, 80))
        params, finish = SamplingParams(), {"type": "length"}
        if trial % 2:
            ids, params, finish = stopped(tok, ids, rng)
        if trial % 5 == 0:
            params = SamplingParams(stop=params.stop, no_stop_trim=True)
        seed = rng.random()
        new = stream(Detokenizer(tok), ids, params, finish, [1, 1, 2, 3, 8], random.Random(seed))
        old = stream(FullDecode(tok), ids, params, finish, [1, 1, 2, 3, 8], random.Random(seed))
        assert new == old, (ids, params.stop)


# ---- equal to the full decode, multi-byte characters included ------------------------------
@pytest.mark.parametrize("sizes", [[1], [1, 2, 3, 4], [5, 9, 17], [1, 40]])
def test_streamed_text_is_the_full_decode_with_multibyte_characters(tokenizers, sizes):
    rng = random.Random(sum(sizes))
    bl, bf = tokenizers["byte_level"], tokenizers["byte_fallback"]
    lone = [i for i in range(len(bl)) if bl.decode([i]) == "\ufffd"]  # bytes that are no character alone
    texts = ["".join(rng.choice(MULTIBYTE) for _ in range(rng.randint(0, 120))) for _ in range(40)]
    cases = ([(bl, random_ids(bl, rng, rng.randint(0, 200))) for _ in range(60)]
             + [(bl, [rng.choice(lone) for _ in range(rng.randint(0, 200))] + random_ids(bl, rng, 3))
                for _ in range(20)]
             + [(bl, bl(t, add_special_tokens=False)["input_ids"]) for t in texts]
             + [(bf, bf(t, add_special_tokens=False)["input_ids"]) for t in texts])
    for i, (tok, ids) in enumerate(cases):
        params, finish = SamplingParams(), {"type": "length"}
        if i % 2:
            ids, params, finish = stopped(tok, ids, rng)
        deltas = stream(Detokenizer(tok), ids, params, finish, sizes, rng)
        full = tok.decode(ids, skip_special_tokens=True)
        assert "".join(deltas) == trim_at_stop(full, finish.get("matched"), False), (ids, params.stop)
        # Nothing released is ever taken back, and no released text ends inside a character.
        assert all("\ufffd" not in d or "\ufffd" in full for d in deltas)


def test_decoder_alone_matches_the_full_decode_on_bytes_that_never_form_characters(tokenizers):
    """Lone continuation bytes end every window in U+FFFD: the window still moves on."""
    bl = tokenizers["byte_level"]
    stray = next(i for i in range(len(bl)) if bl.decode([i]) == "\ufffd" and bl.decode([i, i]) == "\ufffd" * 2)
    dec = IncrementalDecoder(bl)
    out, longest = [], 0
    for _ in range(3000):
        out.append(dec.feed([stray])[0])
        longest = max(longest, len(dec.ids))
    out.append(dec.feed((), final=True)[0])
    assert "".join(out) == "\ufffd" * 3000
    assert longest <= 80


# ---- stop strings ------------------------------------------------------------------------------
def test_a_stop_string_split_across_updates_is_held_then_cut(tokenizers):
    tok = tokenizers["chars"]
    ids = tok("hello world, more")["input_ids"]
    params = SamplingParams(stop=("o wor",))
    detok = Detokenizer(tok)
    got = [detok.process(update(ids[:4], params)).text_delta]           # "hell"
    got.append(detok.process(update(ids[4:6])).text_delta)              # "o " : could start the stop
    got.append(detok.process(update(ids[6:8])).text_delta)             # "wo" : still could
    got.append(detok.process(update(ids[8:9], finish={"type": "stop", "matched": "o wor"})).text_delta)
    assert got == ["hell", "", "", ""]
    # A start of the stop string that turns out not to be one is released.
    ids = tok("hello wx")["input_ids"]
    detok = Detokenizer(tok)
    got = [detok.process(update(ids[:6], params)).text_delta, detok.process(update(ids[6:7])).text_delta,
           detok.process(update(ids[7:8])).text_delta]
    assert got == ["hell", "", "o wx"]


def test_the_text_is_cut_at_the_first_occurrence_of_the_stop_string(tokenizers):
    """(min_new_tokens lets a stop string pass once; the finish names it later.)"""
    tok = tokenizers["chars"]
    ids = tok("a;b;c")["input_ids"]
    params = SamplingParams(stop=(";",))
    for new in (Detokenizer(tok), FullDecode(tok)):
        deltas = [new.process(update(ids[:2], params)), new.process(update(ids[2:4])),
                  new.process(update(ids[4:], finish={"type": "stop", "matched": ";"}))]
        assert [d if isinstance(d, str) else d.text_delta for d in deltas] == ["a;", "b;", ""]


def test_stop_scan_against_the_quadratic_scan():
    rng = random.Random(5)
    for _ in range(300):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3)))
        scan, text = StopScan(stops), ""
        while len(text) < 40:
            piece = "".join(rng.choice("abc") for _ in range(rng.choice([1, 1, 2, 7])))
            scan.feed(piece)
            text += piece
            assert scan.hold() == FullDecode.held_back(text, stops), (text, stops)
            assert held_back(text, stops) == FullDecode.held_back(text, stops)
            for s in stops:
                assert scan.first(s) == (text.find(s) if s in text else None)


# ---- cost: bounded state, flat per-token time ---------------------------------------------
def per_token_us(tok: Any, length: int, params: SamplingParams, timed: int = 300) -> float:
    rng = random.Random(length)
    ordinary = [i for i in range(len(tok)) if i not in set(tok.all_special_ids)]
    ids = [rng.choice(ordinary) for _ in range(length)]
    detok = Detokenizer(tok)
    detok.process(update(ids[:-timed], params))
    times = []
    for t in ids[-timed:]:
        start = time.perf_counter()
        detok.process(update([t]))
        times.append(time.perf_counter() - start)
    sample = detok.samples[("r", 0)]
    assert len(sample.decoder.ids) <= 16 and len(sample.pending) <= max(map(len, params.stop), default=0) + 16
    return statistics.median(times) * 1e6


def test_per_token_cost_does_not_grow_with_the_output(tokenizers):
    """The previous detokenizer took about 36x longer per token at 32k output tokens than at
    1k on this machine (docs/benchmarks.md); now the ratio at 64k is about 1."""
    tok = tokenizers["demo"]
    for params in (SamplingParams(), SamplingParams(stop=tuple("\x01" * 255 + chr(0x2460 + i) for i in range(16)))):
        short = min(per_token_us(tok, 1024, params) for _ in range(2))
        long = min(per_token_us(tok, 65536, params) for _ in range(2))
        assert long / short < 4, (params.stop[:1], short, long)


def test_stop_prefix_check_is_linear_in_the_new_text():
    """One more character costs the same whatever the stop strings' length (the previous
    check compared every prefix of every stop string: quadratic in their length)."""
    def us_per_char(stop_len: int) -> float:
        scan = StopScan(tuple("x" * (stop_len - 1) + chr(0x2460 + i) for i in range(16)))
        start = time.perf_counter()
        for _ in range(2000):
            scan.feed("x")
            scan.hold()
        return (time.perf_counter() - start) / 2000 * 1e6
    short = min(us_per_char(8) for _ in range(3))
    long = min(us_per_char(4096) for _ in range(3))
    assert long / short < 4, (short, long)
