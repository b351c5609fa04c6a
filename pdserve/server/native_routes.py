"""SGLang's native POST /generate."""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.config import ServerArgs
from pdserve.scheduler.messages import NewRequest
from pdserve.server.http_common import bootstrap_of, client_gone, client_rids, error_body, sse
from pdserve.server.protocol import GenerateRequest, from_value_error, refuse_unsupported
from pdserve.server.request_state import Job
from pdserve.server.results import SampleOutput, TokenTexts, native_result
from pdserve.server.tokenizer_manager import ServerUnavailable, TokenizerManager


def check_generate_fields(req: GenerateRequest) -> None:
    """What /generate refuses beyond its schema (logprob_start_len is checked against the
    prompts when they are tokenized)."""
    refuse_unsupported(req)


def generate_requests(args: ServerArgs, manager: TokenizerManager, req: GenerateRequest
                      ) -> tuple[list[NewRequest], bool]:
    """The scheduler messages of a /generate body and whether it named a single prompt.
    Raises ValueError naming the field."""
    b = manager.builder
    prompts, single = b.token_ids(req.text, req.input_ids, "text", "input_ids")
    params = b.sampling_params(req.sampling_params, len(prompts))
    rids = None
    if req.rid is not None:
        rids = [req.rid] if isinstance(req.rid, str) else list(req.rid)
    start = -1 if req.logprob_start_len is None else req.logprob_start_len
    # Prompt logprobs are bounded (--max-prompt-logprob-entries): a 2000-token prompt with
    # n=16 and 20 alternatives asked for a response 2000x the body's size.
    return b.build(prompts, params, req.return_logprob, req.top_logprobs_num, rids,
                   bootstrap_of(args, req, params), logprob_start_len=start,
                   max_prompt_logprob_entries=args.max_prompt_logprob_entries), single


async def generate_events(manager: TokenizerManager, job: Job, token_text: TokenTexts | None
                          ) -> AsyncIterator[str]:
    """A streamed /generate: per update, the sample's result so far (cumulative text)."""
    try:
        async for state, update in manager.stream(job):
            if update.text_delta or update.token.new_ids or update.token.finish:
                # `index` tells the samples of a batch or of n > 1 apart (as in SGLang).
                index = job.flat_index(state, update.token.index)
                sample = state.samples[update.token.index]
                yield sse(dict(native_result(SampleOutput.of_sample(state, sample), token_text), index=index))
    except ServerUnavailable as exc:
        yield sse(error_body(str(exc), "server_error", None, 503))
    yield sse("[DONE]")


class NativeRoutes:
    def __init__(self, args: ServerArgs, manager: TokenizerManager) -> None:
        self.args = args
        self.manager = manager
        self.texts = TokenTexts(manager.tokenizer)

    def register(self, app: FastAPI) -> None:
        app.post("/generate")(self.generate)

    async def generate(self, req: GenerateRequest, request: Request) -> Response:
        check_generate_fields(req)
        try:
            with self.manager.preparing_rids(client_rids(req.rid)):
                requests, single = await self.manager.off_loop(generate_requests, self.args, self.manager, req)
                job = await self.manager.submit(requests)
        except ValueError as exc:
            raise from_value_error(exc) from None
        token_text = self.texts if req.return_text_in_logprobs else None
        if req.stream:
            return StreamingResponse(generate_events(self.manager, job, token_text), media_type="text/event-stream")
        await self.manager.wait(job, client_gone(request))
        results = [native_result(SampleOutput.of_sample(st, s), token_text) for st in job.states for s in st.samples]
        return JSONResponse(results[0] if single and len(results) == 1 else results)
