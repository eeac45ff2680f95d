"""The prefill loop with a prefill sent before its ticket (the router does not wait for the decode worker):
the first token comes at once, the KV waits in the worker's blocks for ``attach``, then moves whole; a
ticket given up, never coming, or not fitting frees the blocks. A real runner (tiny model, CPU) and a
recording stand-in for the KV sender."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.params import SamplingParams, choice_params
from pdserve.engine.sampler import Sampler
from pdserve.prefill_pool import loop as loop_mod
from pdserve.prefill_pool import tickets
from pdserve.prefill_pool.loop import PrefillLoop
from pdserve.prefill_pool.metrics import PrefillMetrics

PROMPT = list(range(5, 40))


class _Handle:
    def __init__(self, sender: _Sender, ticket, blocks) -> None:  # type: ignore[no-untyped-def]
        self.sender, self.ticket, self.blocks = sender, ticket, list(blocks)
        self.num_layers = sender.num_layers
        self.pushed: list[int] = []
        self.during_forward: list[bool] = []  # per push: was the forward still running
        self.completed: int | None = None
        self.choice_tokens: tuple[int, ...] = ()  # an n > 1 request's other choices' first tokens
        self.aborted: str | None = None
        self.groups: list[tuple[int, int]] = []  # push_layers calls: (first, count)

    def push_layer(self, layer: int) -> None:
        assert layer not in self.pushed, f"layer {layer} pushed twice"
        self.pushed.append(layer)
        self.during_forward.append(self.sender.forward_running())

    def push_layers(self, first: int, count: int) -> None:
        self.groups.append((first, count))
        for layer in range(first, first + count):
            self.push_layer(layer)

    async def complete(self, first: int, choice_tokens: tuple[int, ...] = ()) -> None:
        assert sorted(self.pushed) == list(range(self.num_layers)), "completed before every layer was pushed"
        self.completed, self.choice_tokens = first, choice_tokens

    async def abort(self, reason: str) -> None:
        self.aborted = reason


class _Sender:
    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.handles: list[_Handle] = []
        self.forward_running = lambda: False

    async def open(self, ticket, blocks) -> _Handle:  # type: ignore[no-untyped-def]
        h = _Handle(self, ticket, blocks)
        self.handles.append(h)
        return h


def _ticket(n: int = len(PROMPT)) -> SimpleNamespace:
    return SimpleNamespace(num_tokens=n)


async def _until(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


@pytest.fixture(scope="module")
def runner(tiny_llama_dir) -> ModelRunner:  # type: ignore[no-untyped-def]
    return ModelRunner(tiny_llama_dir, block_size=4, num_blocks=64)


def _loop(runner: ModelRunner) -> tuple[PrefillLoop, _Sender]:
    sender = _Sender(runner.config.num_layers)
    loop = PrefillLoop(runner, runner.sampler(()), sender, 256, PrefillMetrics(CollectorRegistry()))  # type: ignore[arg-type]
    loop.start()
    return loop, sender


def _used(loop: PrefillLoop) -> int:
    return loop.sched.block_manager.num_used


def test_the_first_token_comes_before_the_ticket_and_the_kv_moves_whole_after(runner: ModelRunner) -> None:
    async def main() -> None:
        loop, sender = _loop(runner)
        params = SamplingParams(temperature=0.0, max_tokens=4)
        _, result = loop.submit("r", PROMPT, params, None)
        first, _ = await asyncio.wait_for(result, 30)  # answered with no ticket anywhere
        assert sender.handles == [] and _used(loop) > 0  # the KV waits in this worker's blocks
        ticket = _ticket()
        loop.attach("r", ticket)  # type: ignore[arg-type]
        await _until(lambda: sender.handles and sender.handles[0].completed is not None)
        h = sender.handles[0]
        assert h.ticket is ticket and h.completed == first and h.pushed == list(range(h.num_layers))
        await _until(lambda: _used(loop) == 0)
        # The same prompt with its ticket at submit: the same token, the layers pushed by the forward.
        _, result = loop.submit("s", PROMPT, params, _ticket())  # type: ignore[arg-type]
        assert (await asyncio.wait_for(result, 30))[0] == first
        await _until(lambda: _used(loop) == 0)
        await loop.close()

    asyncio.run(main())


def test_n_choices_sample_every_first_token_from_one_forward_and_one_transfer(runner: ModelRunner) -> None:
    """An n = 3 prompt: one forward, one transfer, whose completion carries every choice's first token,
    each what a request of its own with the derived seed samples."""

    async def main() -> None:
        loop, sender = _loop(runner)
        params = SamplingParams(n=3, seed=11, max_tokens=4)
        job, result = loop.submit("r", PROMPT, params, _ticket())  # type: ignore[arg-type]
        first, _ = await asyncio.wait_for(result, 30)
        await _until(lambda: sender.handles and sender.handles[0].completed is not None)
        (h,) = sender.handles
        assert h.completed == first and len(h.choice_tokens) == 2 == len(job.payload.choice_tokens)
        alone = []
        for i in range(3):
            _, r = loop.submit(f"s{i}", PROMPT, choice_params(params, i), _ticket())  # type: ignore[arg-type]
            alone.append((await asyncio.wait_for(r, 30))[0])
        assert [first, *h.choice_tokens] == alone
        await _until(lambda: _used(loop) == 0)
        await loop.close()

    asyncio.run(main())


def test_n_choices_each_get_their_first_tokens_logprobs_and_the_prompts_once(runner: ModelRunner) -> None:
    """n = 3 with logprobs: each choice's first token comes with its own entry (of its own token), equal to
    a request of its own with the derived seed; the prompt's are computed once for the request."""

    async def main() -> None:
        loop, _ = _loop(runner)
        params = SamplingParams(n=3, seed=11, max_tokens=4, logprobs=2, prompt_logprobs=1)
        job, result = loop.submit("r", PROMPT, params, _ticket())  # type: ignore[arg-type]
        first, _ = await asyncio.wait_for(result, 30)
        req = job.payload
        entries = [req.first_logprobs, *req.choice_logprobs]
        assert [e.token_id for e in entries] == [first, *req.choice_tokens]
        assert all(len(e.top_ids) == 2 for e in entries)
        assert req.prompt_logprobs is not None and len(req.prompt_logprobs) == len(PROMPT) - 1
        for i in range(3):
            one = dataclasses.replace(choice_params(params, i), prompt_logprobs=None)
            j, r = loop.submit(f"s{i}", PROMPT, one, _ticket())  # type: ignore[arg-type]
            await asyncio.wait_for(r, 30)
            assert j.payload.first_logprobs.token_id == entries[i].token_id
            assert abs(j.payload.first_logprobs.logprob - entries[i].logprob) < 1e-4
        await _until(lambda: _used(loop) == 0)
        await loop.close()

    asyncio.run(main())


def test_the_first_tokens_penalties_and_bias_see_the_prompt(runner: ModelRunner) -> None:
    """The sampler gets each job's prompt (penalties count it); a strong negative bias moves token 0."""

    seen: list = []

    class Recording(Sampler):
        def __call__(self, logits, rows, token_mask=None):  # type: ignore[no-untyped-def]
            seen.extend(rows)
            return super().__call__(logits, rows, token_mask)

    async def main() -> None:
        sender = _Sender(runner.config.num_layers)
        sampler = Recording(())
        loop = PrefillLoop(runner, sampler, sender, 256, PrefillMetrics(CollectorRegistry()))  # type: ignore[arg-type]
        loop.start()
        greedy = SamplingParams(temperature=0.0, max_tokens=4)
        _, result = loop.submit("plain", PROMPT, greedy, _ticket())  # type: ignore[arg-type]
        plain = (await asyncio.wait_for(result, 30))[0]
        biased = SamplingParams(
            temperature=0.0, max_tokens=4, logit_bias={plain: -100}, repetition_penalty=1.2
        )
        _, result = loop.submit("biased", PROMPT, biased, _ticket())  # type: ignore[arg-type]
        assert (await asyncio.wait_for(result, 30))[0] != plain
        assert [list(r.prompt_token_ids) for r in seen] == [PROMPT, PROMPT]
        assert all(r.output_index == 0 and not r.output_token_ids for r in seen)
        await _until(lambda: _used(loop) == 0)
        await loop.close()

    asyncio.run(main())


def test_a_ticket_before_its_prefill_is_kept_for_it(runner: ModelRunner) -> None:
    async def main() -> None:
        loop, sender = _loop(runner)
        loop.attach("early", _ticket())  # type: ignore[arg-type]
        loop.attach("nobody", None)  # a drop for a request not here: nothing kept
        assert list(loop.tickets._early) == [("early", "")]
        _, result = loop.submit("early", PROMPT, SamplingParams(temperature=0.0), None)
        await asyncio.wait_for(result, 30)
        await _until(lambda: sender.handles and sender.handles[0].completed is not None)
        await _until(lambda: _used(loop) == 0)
        await loop.close()

    asyncio.run(main())


@pytest.mark.parametrize("how", ["dropped", "never", "misfit"])
def test_kv_whose_ticket_does_not_come_is_freed(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.setattr(tickets, "TICKET_WAIT_S", 0.3)

    async def main() -> None:
        loop, sender = _loop(runner)
        _, result = loop.submit("r", PROMPT, SamplingParams(temperature=0.0), None)
        await asyncio.wait_for(result, 30)
        assert _used(loop) > 0
        if how == "dropped":
            loop.attach("r", None)  # the router gave the request up
        elif how == "misfit":
            with pytest.raises(ValueError, match="ticket reserves 3 tokens"):
                loop.attach("r", _ticket(3))  # type: ignore[arg-type]
        await _until(lambda: _used(loop) == 0)  # "never": after TICKET_WAIT_S
        assert sender.handles == []
        await loop.close()

    asyncio.run(main())


class _SlowRunner:
    """A forward of ``num_layers`` layers, 20 ms each, that says how far it got; token 3 always."""

    def __init__(self, num_layers: int = 8) -> None:
        self.config = SimpleNamespace(num_layers=num_layers, vocab_size=16, max_position_embeddings=4096)
        self.num_blocks, self.block_size = 64, 4
        self.layers = 0
        self.running = threading.Event()

    def prefill(self, items, hook):  # type: ignore[no-untyped-def]
        self.running.set()
        try:
            for layer in range(self.config.num_layers):
                time.sleep(0.02)
                self.layers = layer + 1
                hook(layer, None, None)
        finally:
            self.running.clear()
        logits = torch.zeros(len(items), 16)
        logits[:, 3] = 1.0
        return logits


def test_a_ticket_that_comes_mid_forward_streams_the_rest_of_the_layers() -> None:
    """The written layers go at once when the ticket comes, the later ones as the forward writes them:
    each exactly once, and the completion only after the forward."""

    async def main() -> None:
        runner = _SlowRunner()
        sender = _Sender(runner.config.num_layers)
        sender.forward_running = runner.running.is_set
        loop = PrefillLoop(runner, Sampler(()), sender, 256, PrefillMetrics(CollectorRegistry()))  # type: ignore[arg-type]
        loop.start()
        _, result = loop.submit("m", PROMPT, SamplingParams(temperature=0.0), None)
        await _until(lambda: runner.layers >= 3)
        loop.attach("m", _ticket())  # type: ignore[arg-type]
        assert (await asyncio.wait_for(result, 30))[0] == 3
        await _until(lambda: sender.handles and sender.handles[0].completed is not None)
        h = sender.handles[0]
        assert sorted(h.pushed) == list(range(runner.config.num_layers)) and h.completed == 3
        assert any(h.during_forward), "no layer went out while the forward ran"
        await _until(lambda: _used(loop) == 0)
        await loop.close()

    asyncio.run(main())


class _GraphRunner(_SlowRunner):
    """A prefill under a CUDA graph: every layer is written before the hook hears of any, then
    ``layers_written`` once (a hook without it would get a call per layer)."""

    def prefill(self, items, hook):  # type: ignore[no-untyped-def]
        self.layers = self.config.num_layers
        hook.layers_written(self.config.num_layers)
        logits = torch.zeros(len(items), 16)
        logits[:, 3] = 1.0
        return logits


def test_a_graphed_forward_pushes_every_layer_in_one_call() -> None:
    """With its ticket at submit, a job's transfer gets all layers of a graphed forward in one
    ``push_layers``; one whose ticket comes later gets them in the catch-up's one call."""

    async def main() -> None:
        runner = _GraphRunner()
        sender = _Sender(runner.config.num_layers)
        loop = PrefillLoop(runner, Sampler(()), sender, 256, PrefillMetrics(CollectorRegistry()))  # type: ignore[arg-type]
        loop.start()
        n = runner.config.num_layers
        _, result = loop.submit("g", PROMPT, SamplingParams(temperature=0.0), _ticket())  # type: ignore[arg-type]
        assert (await asyncio.wait_for(result, 30))[0] == 3
        await _until(lambda: sender.handles and sender.handles[0].completed is not None)
        assert sender.handles[0].groups == [(0, n)] and sender.handles[0].pushed == list(range(n))
        _, result = loop.submit("late", PROMPT, SamplingParams(temperature=0.0), None)
        await asyncio.wait_for(result, 30)
        loop.attach("late", _ticket())  # type: ignore[arg-type]
        await _until(lambda: len(sender.handles) == 2 and sender.handles[1].completed is not None)
        assert sender.handles[1].groups == [(0, n)]
        await _until(lambda: _used(loop) == 0)
        await loop.close()

    asyncio.run(main())


class _SlowOpenSender(_Sender):
    async def open(self, ticket, blocks) -> _Handle:  # type: ignore[no-untyped-def]
        if getattr(ticket, "slow", False):
            await asyncio.sleep(0.3)  # a handshake with a new decode worker
        return await super().open(ticket, blocks)


def test_a_late_ticket_during_the_batchs_own_opening_keeps_its_transfer() -> None:
    """Job y's transfer opens slowly; x's ticket comes meanwhile and x's late transfer opens at once:
    the batch's opening must not drop x's handle (every layer still reaches it, then the completion)."""

    async def main() -> None:
        runner = _SlowRunner()
        sender = _SlowOpenSender(runner.config.num_layers)
        loop = PrefillLoop(runner, Sampler(()), sender, 256, PrefillMetrics(CollectorRegistry()))  # type: ignore[arg-type]
        y = SimpleNamespace(num_tokens=len(PROMPT), slow=True)
        loop.submit("y", PROMPT, SamplingParams(temperature=0.0), y)  # type: ignore[arg-type]
        _, rx = loop.submit("x", PROMPT, SamplingParams(temperature=0.0), None)
        loop.start()
        await asyncio.sleep(0.05)  # the batch waits on y's open
        loop.attach("x", _ticket())  # type: ignore[arg-type]
        await asyncio.wait_for(rx, 10)
        await _until(lambda: _used(loop) == 0)
        hx = next(h for h in sender.handles if not getattr(h.ticket, "slow", False))
        assert sorted(hx.pushed) == list(range(runner.config.num_layers)) and hx.completed == 3
        await loop.close()

    asyncio.run(main())


class _FailingRunner(_SlowRunner):
    def prefill(self, items, hook):  # type: ignore[no-untyped-def]
        for layer in range(3):
            hook(layer, None, None)
        raise RuntimeError("boom")


def test_a_ticket_right_after_a_failed_forward_opens_nothing() -> None:
    """The forward failed and the loop is freeing the job's blocks: a ticket that comes in between must
    not open a transfer (it would send blocks that may be someone else's by then)."""

    async def main() -> None:
        runner = _FailingRunner()
        sender = _Sender(runner.config.num_layers)
        loop = PrefillLoop(runner, Sampler(()), sender, 256, PrefillMetrics(CollectorRegistry()))  # type: ignore[arg-type]
        over = loop._forward_over

        def then_attach(job, first):  # type: ignore[no-untyped-def]
            over(job, first)
            loop.attach(job.request_id, _ticket())  # handled before the finishing task's first step

        loop._forward_over = then_attach  # type: ignore[method-assign]
        _, rx = loop.submit("x", PROMPT, SamplingParams(temperature=0.0), None)
        loop.start()
        with pytest.raises(RuntimeError, match="prefill failed"):
            await asyncio.wait_for(rx, 10)
        await _until(lambda: _used(loop) == 0)
        await asyncio.sleep(0.1)
        assert all(h.pushed == [] and h.completed is None for h in sender.handles)
        await loop.close()

    asyncio.run(main())


def test_a_late_drop_or_ticket_of_an_earlier_attempt_never_reaches_a_retry() -> None:
    """Attempts of one request id carry their own attach keys: attempt 1's late drop and ticket leave
    attempt 2 alone, which gets its own ticket and completes."""

    async def main() -> None:
        runner = _SlowRunner()
        sender = _Sender(runner.config.num_layers)
        loop = PrefillLoop(runner, Sampler(()), sender, 256, PrefillMetrics(CollectorRegistry()))  # type: ignore[arg-type]
        loop.start()
        _, r2 = loop.submit("r", PROMPT, SamplingParams(temperature=0.0), None, attach_key="a2")
        assert loop.attach("r", None, "a1")  # attempt 1's drop: nothing of attempt 2's is touched
        stale, mine = _ticket(), _ticket()
        assert loop.attach("r", stale, "a1")  # kept a while for an attempt 1 that never comes
        assert loop.attach("r", mine, "a2")  # type: ignore[arg-type]
        assert (await asyncio.wait_for(r2, 10))[0] == 3
        await _until(lambda: sender.handles and sender.handles[0].completed is not None)
        assert [h.ticket for h in sender.handles] == [mine]
        await _until(lambda: _used(loop) == 0)
        await loop.close()

    asyncio.run(main())


def test_a_dropped_request_gets_an_answer() -> None:
    async def main() -> None:
        runner = _SlowRunner()
        loop = PrefillLoop(runner, Sampler(()), _Sender(8), 256, PrefillMetrics(CollectorRegistry()))  # type: ignore[arg-type]
        loop.start()
        _, result = loop.submit("d", PROMPT, SamplingParams(temperature=0.0), None, attach_key="k")
        await _until(lambda: runner.layers >= 1)
        loop.attach("d", None, "k")
        with pytest.raises(Exception, match="gave the request up"):
            await asyncio.wait_for(result, 10)
        await _until(lambda: _used(loop) == 0)
        await loop.close()

    asyncio.run(main())


def test_forwards_that_keep_failing_stop_the_loop_and_the_worker_is_told(runner: ModelRunner) -> None:
    """One failed forward fails its batch; MAX_FAILED_FORWARDS in a row mean the model is broken: the loop
    stops (its batch failed and freed), ``on_fatal`` runs, and new prompts are refused at once."""

    async def main() -> None:
        loop, _ = _loop(runner)
        fatal: list[BaseException] = []
        loop.on_fatal(fatal.append)

        def broken(*_args):  # type: ignore[no-untyped-def]
            raise RuntimeError("device lost")

        loop._forward = broken  # type: ignore[method-assign]
        loop.on_forward_failed(loop.metrics.failed_steps.inc)
        params = SamplingParams(temperature=0.0)
        for i in range(loop_mod.MAX_FAILED_FORWARDS - 1):
            _, rx = loop.submit(f"r{i}", PROMPT, params, None)
            with pytest.raises(RuntimeError, match="prefill failed"):
                await asyncio.wait_for(rx, 10)
            assert not fatal
        _, rx = loop.submit("last", PROMPT, params, _ticket())  # type: ignore[arg-type]
        with pytest.raises(loop_mod.PrefillLoopStopped):
            await asyncio.wait_for(rx, 10)
        assert len(fatal) == 1 and isinstance(fatal[0], loop_mod.PrefillLoopStopped)
        failed = loop.metrics.registry.get_sample_value("pdserve_failed_steps_total", {"role": "prefill"})
        assert failed == loop_mod.MAX_FAILED_FORWARDS
        with pytest.raises(loop_mod.PrefillLoopStopped):
            loop.submit("after", PROMPT, params, None)
        await _until(lambda: _used(loop) == 0)
        await loop.close()

    asyncio.run(main())


def test_an_error_outside_the_forward_fails_and_frees_the_batch_in_flight(runner: ModelRunner) -> None:
    """The loop dies between scheduling a batch and answering it: that batch is answered with the error
    and its blocks come back (they were not in the queue any more)."""

    async def main() -> None:
        loop, _ = _loop(runner)
        fatal: list[BaseException] = []
        loop.on_fatal(fatal.append)

        def unlucky(*_args):  # type: ignore[no-untyped-def]
            raise KeyError("a bug after the forward")

        loop._observe = unlucky  # type: ignore[method-assign]
        _, rx = loop.submit("r", PROMPT, SamplingParams(temperature=0.0), None)
        with pytest.raises(loop_mod.PrefillLoopStopped, match="KeyError"):
            await asyncio.wait_for(rx, 10)
        assert len(fatal) == 1
        await _until(lambda: _used(loop) == 0)
        await loop.close()

    asyncio.run(main())


def test_the_prefill_servicer_tells_the_router_to_retry_a_failed_forward_elsewhere() -> None:
    """A failed forward is the worker's fault: the call ends with the trailing metadata the router moves
    the request on (and INTERNAL for anything else, which it does not)."""
    import grpc

    from pdserve.prefill_pool.servicer import PrefillServicer
    from pdserve.proto import worker_pb2
    from pdserve.worker.shell import RETRY_ELSEWHERE_KEY, ShellConfig, WorkerShell
    from tests.unit.fake_grpc import Aborted, AbortingContext

    async def call(error: BaseException) -> tuple:
        loop = asyncio.get_running_loop()
        result = loop.create_future()
        result.set_exception(error)
        fake = SimpleNamespace(
            runner=SimpleNamespace(config=SimpleNamespace(vocab_size=100, max_position_embeddings=64)),
            submit=lambda *a, **k: (SimpleNamespace(payload=SimpleNamespace(first_token_unix=0.0)), result),
            give_up=lambda *a: None,
        )
        servicer = PrefillServicer(WorkerShell(ShellConfig()), PrefillMetrics(CollectorRegistry()))
        servicer.attach(fake)  # type: ignore[arg-type]
        ctx = AbortingContext()
        with pytest.raises(Aborted):
            await servicer.Prefill(worker_pb2.PrefillRequest(request_id="r", prompt_token_ids=[1, 2]), ctx)
        return ctx.aborted

    async def main() -> None:
        code, _, trailing = await call(loop_mod.ForwardFailed("prefill failed: RuntimeError('x')"))
        assert code is grpc.StatusCode.INTERNAL and (RETRY_ELSEWHERE_KEY, "step_failed") in trailing
        code, _, trailing = await call(RuntimeError("something else"))
        assert code is grpc.StatusCode.INTERNAL and not trailing
        code, _, _ = await call(loop_mod.PrefillLoopStopped("stopped"))
        assert code is grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_giving_up_the_queues_blocked_head_lets_the_next_job_run(tiny_llama_dir) -> None:
    """Code review: the queue's head waits for blocks that a prefilled job's KV holds (its ticket has not
    come); the router gives the head up. The job behind it fits: it used to wait for some unrelated wake
    (the held KV's ticket wait, up to TICKET_WAIT_S)."""
    small = ModelRunner(tiny_llama_dir, block_size=4, num_blocks=16)  # 64 token slots

    async def main() -> None:
        loop, _ = _loop(small)
        p = SamplingParams(temperature=0.0, max_tokens=4)
        _, ra = loop.submit("a", list(range(5, 53)), p, None)  # 12 blocks, no ticket yet
        await asyncio.wait_for(ra, 30)  # answered; its KV waits for the ticket, holding 12 blocks
        # (Other tokens than a's: no cached prefix to share.)
        head, _ = loop.submit("h", list(range(105, 145)), p, None)  # 10 blocks: does not fit now
        _, rj = loop.submit("j", list(range(205, 213)), p, None)  # 2 blocks: fits, but behind h
        await asyncio.sleep(0.2)
        assert not rj.done()
        loop.give_up(head, "cancelled by the router")
        try:
            await asyncio.wait_for(asyncio.shield(rj), 5)
        finally:
            loop.attach("a", None)
            loop.attach("j", None)
            await _until(lambda: _used(loop) == 0)
            await loop.close()

    asyncio.run(main())


def test_a_late_transfer_that_does_not_open_is_told_to_the_router_through_its_ticket(
    runner: ModelRunner,
) -> None:
    """Code review: the prefill answered token 0 before its ticket (the router's usual path); the late
    transfer's open then failed (a connect timeout). Only a warning was logged: AttachTicket said OK, and
    the decode worker's reservation waited for the request's deadline (600 s). ``attach_and_open`` now
    raises the open's failure (AttachTicket answers ABORTED: the router moves the request)."""

    async def main() -> None:
        loop, sender = _loop(runner)
        params = SamplingParams(temperature=0.0, max_tokens=4)
        _, rx = loop.submit("r", PROMPT, params, None)
        await asyncio.wait_for(rx, 30)  # token 0, no ticket yet

        async def broken(_ticket, _blocks):  # type: ignore[no-untyped-def]
            raise ConnectionError("handshake with the decode worker timed out")

        sender.open = broken  # type: ignore[method-assign]
        with pytest.raises(tickets.LateOpenFailed, match="did not open: handshake"):
            await loop.attach_and_open("r", _ticket())  # type: ignore[arg-type]
        await _until(lambda: _used(loop) == 0)
        # An open that works answers OK (and a ticket the router gave up on, at once).
        _, rx = loop.submit("s", PROMPT, params, None)
        await asyncio.wait_for(rx, 30)
        sender.open = _Sender.open.__get__(sender)  # type: ignore[method-assign]
        assert await loop.attach_and_open("s", _ticket())  # type: ignore[arg-type]
        await _until(lambda: _used(loop) == 0)
        assert sender.handles[-1].completed is not None
        await loop.close()

    asyncio.run(main())


def test_a_late_transfer_still_opening_past_the_bound_is_told_to_the_router_and_aborted_unused(
    runner: ModelRunner,
) -> None:
    """Review: an open still pending after AttachTicket's bound (a connect that hangs) answered OK; when it
    failed later, nobody told the router, and the decode worker's reservation waited for the deadline. Now
    the bound raises (the router moves the request) and a transfer that opens after it is aborted unused."""

    async def main() -> None:
        loop, sender = _loop(runner)
        params = SamplingParams(temperature=0.0, max_tokens=4)
        _, rx = loop.submit("r", PROMPT, params, None)
        await asyncio.wait_for(rx, 30)
        gate = asyncio.Event()
        plain = _Sender.open.__get__(sender)

        async def hanging(ticket, blocks):  # type: ignore[no-untyped-def]
            await gate.wait()
            return await plain(ticket, blocks)

        sender.open = hanging  # type: ignore[method-assign]
        with pytest.raises(tickets.LateOpenFailed, match="did not open within"):
            await loop.attach_and_open("r", _ticket(), wait_s=0.2)  # type: ignore[arg-type]
        gate.set()  # it opens after all: aborted, never pushed to, and P's blocks come back
        await _until(lambda: _used(loop) == 0)
        await _until(lambda: bool(sender.handles) and sender.handles[-1].aborted is not None)
        assert sender.handles[-1].pushed == [] and sender.handles[-1].completed is None
        await loop.close()

    asyncio.run(main())
