"""The reasoning parser (`--reasoning-parser`, pdserve/server/reasoning.py) alone and in the
chat response builders, on fixed texts and fake token streams: streamed deltas split at
every position (inside `<think>` and `</think>` included) add up to the whole parse,
qwen3 and deepseek-r1 conventions, no tags, an unclosed block, and what the request
fields `separate_reasoning` and `chat_template_kwargs.enable_thinking` select."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from pdserve.sampling_params import SamplingParams
from pdserve.server.messages import TextUpdate, TokenUpdate
from pdserve.server.openai_routes import ChatChunks, chat_message
from pdserve.server.reasoning import ReasoningParser, parser_for
from pdserve.server.tokenizer_manager import RequestState, SampleResult

pytestmark = pytest.mark.fast

QWEN3, R1 = False, True  # starts_in_reasoning

# (starts_in_reasoning, output, reasoning, content)
CASES = [
    (QWEN3, "<think>\nLet me add: 2 + 3 = 5.\n</think>\n\nThe answer is 5.",
     "\nLet me add: 2 + 3 = 5.\n", "The answer is 5."),
    (QWEN3, "No thinking here, <thin or </think either.", "", "No thinking here, <thin or </think either."),
    (QWEN3, "  \n<think>a < b</think>x", "a < b", "x"),
    # Only a leading <think> opens the reasoning (issue 39, as vLLM): after content it is text.
    (QWEN3, "Intro <think>why</think> rest <think>not again</think>",
     "", "Intro <think>why</think> rest <think>not again</think>"),
    (QWEN3, " \n<think>a</think>b <think>c</think>", "a", "b <think>c</think>"),
    (QWEN3, "<think>never closed, cut at max_tokens </thi", "never closed, cut at max_tokens </thi", ""),
    (QWEN3, "ends on a partial tag <thi", "", "ends on a partial tag <thi"),
    (QWEN3, "", "", ""),
    (R1, "The prompt opened it. 2+3=5</think>\n\nFive.", "The prompt opened it. 2+3=5", "Five."),
    (R1, "\n<think>\nwrote the tag anyway</think>Five.", "\nwrote the tag anyway", "Five."),
    (R1, "all of it is reasoning: no closing tag", "all of it is reasoning: no closing tag", ""),
    (R1, "</think>", "", ""),
    (R1, "a<think>b</think>c", "a<think>b", "c"),
]


@pytest.mark.parametrize("starts, text, reasoning, content", CASES)
def test_whole_text(starts, text, reasoning, content):
    assert ReasoningParser(starts).parse(text) == (reasoning, content)


def stream(parser: ReasoningParser, pieces) -> tuple[list[str], list[str]]:
    rs, cs = [], []
    for p in pieces:
        r, c = parser.feed(p)
        rs.append(r)
        cs.append(c)
    r, c = parser.flush()
    return rs + [r], cs + [c]


@pytest.mark.parametrize("starts, text, reasoning, content", CASES)
def test_every_two_and_three_way_split_adds_up_to_the_whole(starts, text, reasoning, content):
    """Chunk boundaries anywhere, inside the tags too: no tag text leaks into a delta."""
    n = len(text)
    cuts = [(i,) for i in range(n + 1)] + list(itertools.combinations(range(n + 1), 2))
    for cut in cuts:
        bounds = (0, *cut, n)
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        rs, cs = stream(ReasoningParser(starts), pieces)
        assert ("".join(rs), "".join(cs)) == (reasoning, content), pieces


def test_one_character_at_a_time_holds_back_only_a_possible_tag():
    text = "<think>ab</think>cd"
    rs, cs = stream(ReasoningParser(QWEN3), list(text))
    # Nothing comes out while "<think>" is still arriving, "a" and "b" come at once,
    # "</think>" is held until complete, then content flows.
    assert rs == ["", "", "", "", "", "", "", "a", "b", "", "", "", "", "", "", "", "", "", "", ""]
    assert cs == [""] * 17 + ["c", "d", ""]


def test_a_false_tag_prefix_is_released_when_it_turns_out_to_be_text():
    p = ReasoningParser(R1)
    assert p.feed("x </th") == ("x ", "")
    assert p.feed("ey said") == ("</they said", "")
    assert p.flush() == ("", "")


def test_parser_for_follows_the_request_fields():
    assert parser_for(None, None, None) is None
    assert parser_for("qwen3", False, None) is None  # separate_reasoning: false
    assert parser_for("qwen3", None, {"enable_thinking": False}) is None  # template closed the thinking
    assert parser_for("qwen3", True, {"enable_thinking": True}) is not None
    assert parser_for("qwen3", None, None).parse("<think>r</think>c") == ("r", "c")
    # deepseek-r1 starts inside the reasoning whatever enable_thinking says
    assert parser_for("deepseek-r1", None, {"enable_thinking": False}).parse("r</think>c") == ("r", "c")


def test_chat_message_with_and_without_a_parser():
    text = "<think>hm</think>\nHi."
    assert chat_message(text, None) == {"role": "assistant", "content": text}
    assert chat_message(text, ReasoningParser(QWEN3)) == {"role": "assistant", "content": "Hi.",
                                                          "reasoning_content": "hm"}
    assert chat_message("Hi.", ReasoningParser(QWEN3)) == {"role": "assistant", "content": "Hi.",
                                                           "reasoning_content": None}
    assert chat_message("still thinking", ReasoningParser(R1)) == {
        "role": "assistant", "content": "", "reasoning_content": "still thinking"}


# ---- the streamed chat builder on a fake token stream ---------------------------------------
def fake_updates(pieces: list[str], index: int = 0) -> tuple[RequestState, list[TextUpdate]]:
    state = RequestState(rid="r", prompt_ids=[1], params=SamplingParams(), samples=[SampleResult(index=index)],
                         queue=asyncio.Queue())
    updates = []
    for i, p in enumerate(pieces):
        last = i == len(pieces) - 1
        tok = TokenUpdate(rid="r", index=0, new_ids=(i,), new_logprobs=(), new_top_logprobs=(),
                          finish={"type": "stop"} if last else None, prompt_tokens=1, cached_tokens=0,
                          completion_tokens=i + 1, retractions=0, spec_verify_ct=0, spec_accepted_drafts=0,
                          params=None)
        updates.append(TextUpdate(token=tok, text_delta=p))
    return state, updates


def run_chunks(pieces: list[str], parser_factory) -> list[dict]:
    state, updates = fake_updates(pieces)
    chunks = ChatChunks(None, parser_factory)
    return [c for u in updates for c in chunks(state, u)]


def test_streamed_reasoning_deltas_come_before_content_and_add_up():
    pieces = ["<th", "ink>Two plus", " three</th", "ink>\n\nFi", "ve", "."]
    choices = run_chunks(pieces, lambda: ReasoningParser(QWEN3))
    deltas = [c["delta"] for c in choices]
    assert deltas[0]["role"] == "assistant"
    assert all(set(d) <= {"role", "content", "reasoning_content"} for d in deltas)
    # one kind per delta (the role aside), every reasoning delta before the first content
    # delta (the role's chunk may carry an empty content: nothing was known yet)
    assert deltas[0] == {"role": "assistant", "content": ""}
    kinds = [k for d in deltas for k, v in d.items() if k != "role" and v]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning_content"), kinds
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two plus three"
    assert "".join(d.get("content", "") for d in deltas) == "Five."
    assert [c["finish_reason"] for c in choices][-1] == "stop"
    assert all(c["finish_reason"] is None for c in choices[:-1])


def test_reasoning_and_content_of_one_update_go_as_two_chunks():
    choices = run_chunks(["<think>a</think>b"], lambda: ReasoningParser(QWEN3))
    assert [c["delta"] for c in choices] == [{"role": "assistant", "reasoning_content": "a"}, {"content": "b"}]
    assert [c["finish_reason"] for c in choices] == [None, "stop"]


def test_a_held_back_partial_tag_is_flushed_at_the_finish():
    choices = run_chunks(["thinking until the end </thi"], lambda: ReasoningParser(R1))
    assert "".join(c["delta"].get("reasoning_content", "") for c in choices) == "thinking until the end </thi"
    assert all("content" not in c["delta"] or c["delta"]["content"] == "" for c in choices)
    assert choices[-1]["finish_reason"] == "stop"


def test_without_a_parser_the_stream_is_unchanged():
    choices = run_chunks(["<think>a", "</think>b"], lambda: None)
    assert [c["delta"] for c in choices] == [{"role": "assistant", "content": "<think>a"}, {"content": "</think>b"}]


# ---- issue 39: a literal <think> after content started ----------------------------------------
def test_a_think_tag_inside_a_tool_call_stays_in_the_call():
    """With qwen3, a `<think>` after the content started (here inside a tool call's
    arguments) moved the rest of the answer into reasoning_content and lost the call. Only
    a leading tag opens the reasoning now (as vLLM's parser splits); whole and streamed a
    character at a time alike."""
    import json

    from pdserve.server.tool_calls import HermesParser, merge_deltas

    args = {"text": "write <think> then </think> literally"}
    text = "Calling it. <tool_call>\n" + json.dumps({"name": "echo", "arguments": args}) + "\n</tool_call>"
    new_tools = lambda: HermesParser(frozenset({"echo"}))  # noqa: E731
    msg = chat_message(text, ReasoningParser(QWEN3), new_tools())
    assert msg["reasoning_content"] is None and msg["content"] == "Calling it."
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [args]

    state, updates = fake_updates(list(text))
    chunks = ChatChunks(None, lambda: ReasoningParser(QWEN3), new_tools)
    deltas = [c["delta"] for u in updates for c in chunks(state, u)]
    assert not any(d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "Calling it."
    calls = merge_deltas([t for d in deltas for t in d.get("tool_calls", ())])
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [args]


def test_after_a_leading_think_block_a_later_tag_is_content():
    text = "<think>plan</think>\nDone: <think>x</think> stays."
    assert ReasoningParser(QWEN3).parse(text) == ("plan", "Done: <think>x</think> stays.")
