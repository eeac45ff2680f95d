"""The last stage on a decode worker: engine deltas -> ``WorkerGenerateResponse`` messages.

Both request paths end here: a local prefill (``servicer``) and an adopted remote prefill (``remote``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from pdserve.decode_pool.engine_loop import QueueItem
from pdserve.engine.llm_engine import RequestOutputDelta
from pdserve.proto import worker_pb2
from pdserve.worker.convert import logprobs_to_proto


async def relay_deltas(
    q: asyncio.Queue[QueueItem], choices: int = 1
) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
    """Turn engine deltas into stream messages, coalescing whatever is already queued (a message per
    choice of an ``n`` > 1 request, ``choices`` of them: the stream ends with the last one's finish).

    ``admitted_unix`` is when the first delta reached this side: the engine had
    taken the request into its batch by then.
    """
    admitted_unix = 0.0
    left = choices
    while True:
        item = await q.get()
        if not admitted_unix:
            admitted_unix = time.time()
        batch: list[RequestOutputDelta] = []
        done = False
        while True:
            if item is None:
                done = True
                break
            if isinstance(item, BaseException):
                raise item
            batch.append(item)
            if item.finish_reason is not None:
                left -= 1
                if not left:
                    break
            if q.empty():
                break
            item = q.get_nowait()
        if batch:
            if choices == 1:
                yield _message(batch, admitted_unix)
            else:
                by_choice: dict[int, list[RequestOutputDelta]] = {}
                for d in batch:
                    by_choice.setdefault(d.choice_index, []).append(d)
                for part in by_choice.values():
                    yield _message(part, admitted_unix)
            if not left:
                return
        if done:
            return


def _message(deltas: list[RequestOutputDelta], admitted_unix: float) -> worker_pb2.WorkerGenerateResponse:
    """One choice's consecutive deltas as one message."""
    ids = [t for d in deltas for t in d.new_token_ids]
    last = deltas[-1]
    msg = worker_pb2.WorkerGenerateResponse(
        first_index=last.num_output_tokens - len(ids),
        token_ids=ids,
        finish_reason=last.finish_reason or "",
        admitted_unix=admitted_unix,
        cached_tokens=last.num_cached_tokens,  # a local prefill's reuse (0 for an adopted one)
        index=last.choice_index,
    )
    if last.logprobs is not None or deltas[0].prompt_logprobs is not None:
        _add_logprobs(msg, deltas)
    return msg


def _add_logprobs(msg: worker_pb2.WorkerGenerateResponse, batch: list[RequestOutputDelta]) -> None:
    """The deltas' logprobs (those they have: an adopted request's token 0 has none) and the prompt's (the
    first delta's, after the prompt's first token, which has none)."""
    msg.logprobs.extend(logprobs_to_proto(e for d in batch if d.logprobs is not None for e in d.logprobs))
    prompt = batch[0].prompt_logprobs
    if prompt is not None:
        msg.prompt_logprobs.extend(logprobs_to_proto(e for e in prompt[1:] if e is not None))
