"""Router test fixtures: a tiny model directory and fake workers.

Fake workers are real gRPC ``Worker`` servicers that stream canned token ids.

They run in the WorkerShell and join the router through the RouterAgent, as the
real pools will, so the router, the shell and the agent are tested together
without the engine. ``serve`` runs one as its own process through
``pdserve worker --worker-module tests.fake_workers`` (kill -9, scale, down tests).

Each request generates ``tokens`` (output index 0..n-1) then finishes with
``finish``. Remote mode: Generate answers with a ticket, waits until the fake
prefill worker "transferred" the KV (``Transfers``), then streams from index 0,
so the router must skip token 0 that the prefill worker already returned.

``tokens`` is the request's undisturbed output, as seeded sampling makes it: a request moved here from
another worker (``output_offset`` k: its prompt carries the k tokens already sent) continues at output
index k with ``tokens[k:]``, as the engine does, and never re-sends what the client already has.
``fail_at`` n: every stream breaks (UNAVAILABLE) after sending n tokens, as under a dying worker.

A request of ``n`` > 1 choices streams choice ``c``'s output ``choice_tokens[c]`` (default: ``tokens``),
one token of each open choice in turn; a moved one's ``resumed_choices`` go on from their own tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from pdserve.decode_pool.metrics import DecodeMetrics
from pdserve.kv_transfer.metrics import Role as TransferRole
from pdserve.kv_transfer.metrics import TransferMetrics
from pdserve.prefill_pool.metrics import PrefillMetrics
from pdserve.proto import generation_pb2, worker_pb2, worker_pb2_grpc
from pdserve.telemetry.exporter import process_registry, serve_metrics
from pdserve.worker.agent import AgentConfig, RouterAgent, run_worker
from pdserve.worker.args import WorkerArgs
from pdserve.worker.convert import ROLE_TO_PROTO, request_id_from_metadata
from pdserve.worker.role import Role
from pdserve.worker.router_set import RouterSet, RouterSetConfig
from pdserve.worker.shell import RETRY_ELSEWHERE_KEY, ShellConfig, WorkerShell

# The test model: a WordLevel vocabulary, so ids("hello world") == [4, 5] and text is easy to check.
WORDS = [
    "<pad>",
    "<s>",
    "</s>",
    "<unk>",
    "hello",
    "world",
    "the",
    "cat",
    "sat",
    "on",
    "mat",
    ":",
    "user",
    "assistant",
    "system",
    "a",
    "b",
    "c",
]
ID = {w: i for i, w in enumerate(WORDS)}
EOS = ID["</s>"]
CONTEXT = 24
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def ids(text: str) -> list[int]:
    return [ID[w] for w in text.split()]


def make_model_dir(path: Path) -> Path:
    """A model directory with only what the router reads: a WordLevel tokenizer, a chat template, limits."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.WordLevel(ID, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<pad>", "<s>", "</s>"])
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>", "bos_token": "<s>", "chat_template": TEMPLATE})
    )
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": CONTEXT, "vocab_size": 32}))
    return path


def _fake_entry(token: int) -> generation_pb2.TokenLogprobs:
    return generation_pb2.TokenLogprobs(
        token_id=token, logprob=-1.0, top_token_ids=[token], top_logprobs=[-1.0]
    )


def _fake_logprobs(msg: worker_pb2.WorkerGenerateResponse, request, remote: bool) -> None:
    """Logprobs where the request asks, as a real worker sends them: none for token 0 of a remote
    prefill (the prefill worker's), the prompt's with a local prefill's token 0."""
    if request.sampling.HasField("logprobs") and not (remote and msg.first_index == 0):
        msg.logprobs.extend(_fake_entry(t) for t in msg.token_ids)
    if request.sampling.HasField("prompt_logprobs") and not remote and msg.first_index == msg.index == 0:
        msg.prompt_logprobs.extend(_fake_entry(t) for t in request.prompt_token_ids[1:])


class Transfers:
    """The fake KV transfer: prefill marks a ticket done, decode waits for it."""

    def __init__(self) -> None:
        self._done: dict[bytes, asyncio.Event] = {}

    def event(self, ticket: bytes) -> asyncio.Event:
        return self._done.setdefault(ticket, asyncio.Event())


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        worker_id: str,
        role: Role,
        tokens: Sequence[int],
        *,
        finish: str = "length",
        transfers: Transfers | None = None,
        kv_blocks_total: int = 64,
        block_size: int = 4,
        max_running: int = 8,
        context_length: int = 0,
        kv_layout: str = "",
        tokenizer_digest: str = "",
        host: str = "127.0.0.1",
        fail_at: int | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.host = host
        self.kv_layout = kv_layout
        self.tokenizer_digest = tokenizer_digest
        self.role = role
        self.tokens = list(tokens)
        self.finish = finish
        self.transfers: Transfers | None = transfers or Transfers()
        self.kv_blocks_total, self.block_size, self.max_running = kv_blocks_total, block_size, max_running
        self.context_length = context_length
        # Test controls: tokens from index ``hold_at`` on wait for ``release``;
        # prefill waits for ``prefill_gate``.
        self.hold_at: int | None = None
        self.release = asyncio.Event()
        self.decode_gate: asyncio.Event | None = None  # remote mode: streaming waits for this too
        self.prefill_gate: asyncio.Event | None = None
        self.prefill_rate = 0.0  # prefill tokens/s its heartbeats report (0: not measured)
        self.attach_gate: asyncio.Event | None = None  # holds AttachTicket answers until set
        self.answer_gate: asyncio.Event | None = None  # holds Prefill answers once the "KV" moved
        self.cached_tokens = 0  # prompt tokens its Prefill answers report reused
        self.refuse_room = 0  # Generate calls still to refuse for room (as a full decode worker)
        self.fail_steps = 0  # Generate calls still to fail as a failed engine step (the worker lives on)
        self.abort_transfers = 0  # remote Generate calls still to end ABORTED: their KV transfer failed
        self.fail_at = fail_at  # each Generate stream breaks after this many tokens (a dying worker)
        self.choice_tokens: list[list[int]] | None = None  # n > 1: each choice's output (default: tokens)
        self.attached: list[tuple[str, bytes]] = []  # AttachTicket calls: (request id, ticket or b"")
        self.tickets: dict[str, bytes] = {}  # attached before their prefill was done
        self.prefilled: set[str] = set()  # request ids whose (fake) prefill is done
        self.requests: list[worker_pb2.WorkerGenerateRequest | worker_pb2.PrefillRequest] = []
        self.metadata_ids: list[str] = []  # the x-request-id metadata of each call, in order
        self.timeouts: list[float | None] = []
        self.started: list[str] = []  # request ids whose token stream started
        self.cancelled: list[str] = []
        self.changed = asyncio.Event()  # set on every start/cancel/hold, for tests to wait on
        self.active: set[str] = set()
        self.shell: WorkerShell | None = None
        self.agent: RouterAgent | RouterSet | None = None
        # The pools' real metric objects, fed with the fake's own timings (``serve`` sets them).
        self.decode_metrics: DecodeMetrics | None = None
        self.prefill_metrics: PrefillMetrics | None = None
        self.transfer_metrics: TransferMetrics | None = None

    def _note(self) -> None:
        self.changed.set()

    async def wait_for(self, predicate, timeout: float = 10.0) -> None:
        """Wait until ``predicate()`` holds (woken by the worker's own events, bounded)."""

        async def loop() -> None:
            while not predicate():
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(loop(), timeout)

    async def Generate(self, request, context):
        self.metadata_ids.append(request_id_from_metadata(context.invocation_metadata()))
        rid = request.request_id
        self.requests.append(request)
        self.timeouts.append(context.time_remaining())
        self.active.add(rid)
        self._note()  # tests wait on ``active`` too (wait_for sleeps until the next note)
        finished = False  # the finish went out: a cancel after it is the caller hanging up, not a cancel
        try:
            if self.refuse_room:
                self.refuse_room -= 1
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode worker has no room")
            if self.fail_steps:
                self.fail_steps -= 1
                await context.abort(
                    grpc.StatusCode.INTERNAL,
                    "engine step failed: RuntimeError('device lost')",
                    trailing_metadata=((RETRY_ELSEWHERE_KEY, "step_failed"),),
                )
            offset = request.output_offset
            remote = request.mode == worker_pb2.PREFILL_MODE_REMOTE
            if remote and offset:  # as the decode servicer: a moved stream's worker prefills it itself
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, "output_offset needs local prefill mode"
                )
            if offset > len(self.tokens):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"output_offset {offset} is past the output"
                )
            if remote:
                ticket = f"ticket:{rid}".encode()
                yield worker_pb2.WorkerGenerateResponse(transfer_ticket=ticket)
                if self.transfers is not None:  # a fake in its own process has no transfer to wait for
                    await self.transfers.event(ticket).wait()
                if self.abort_transfers > 0:  # as the decode servicer, when the prefill peer died mid-push
                    self.abort_transfers -= 1
                    await context.abort(
                        grpc.StatusCode.ABORTED, f"KV transfer for {rid} failed: prefill peer died"
                    )
                if self.decode_gate is not None:
                    await self.decode_gate.wait()
            self.started.append(rid)
            self._note()
            if request.sampling.n > 1:
                async for m in self._choices(request, context, remote):
                    yield m
                return
            last = len(self.tokens) - 1
            hold_at = 1 if rid.startswith("hold-") else self.hold_at
            step_start = time.perf_counter()
            if offset and offset == len(self.tokens):  # every token was sent but the finish
                finished = bool(self.finish)
                yield worker_pb2.WorkerGenerateResponse(first_index=offset, finish_reason=self.finish)
            for i in range(offset, len(self.tokens)):
                t = self.tokens[i]
                if self.fail_at is not None and i - offset >= self.fail_at:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is dying")
                if hold_at is not None and i >= hold_at:
                    self._note()
                    await self.release.wait()
                finish = self.finish if i == last else ""
                msg = worker_pb2.WorkerGenerateResponse(first_index=i, token_ids=[t], finish_reason=finish)
                _fake_logprobs(msg, request, remote)
                finished = bool(finish)
                yield msg
                await asyncio.sleep(0)
                if self.decode_metrics is not None:
                    now = time.perf_counter()
                    self.decode_metrics.observe_step(now - step_start, len(self.active))
                    step_start = now
        except (asyncio.CancelledError, GeneratorExit):
            # A stream cancelled while the handler waits at a ``yield`` is closed there (GeneratorExit).
            if not finished:
                self.cancelled.append(rid)
            self._note()
            raise
        finally:
            self.active.discard(rid)
            self._note()

    def _output(self, index: int) -> list[int]:
        return self.tokens if self.choice_tokens is None else self.choice_tokens[index]

    async def _choices(self, request, context, remote: bool):
        """An n > 1 stream: a token of each open choice in turn (a moved one's choices from their tokens)."""
        resumed = {c.index: len(c.token_ids) for c in request.resumed_choices}
        at = resumed or dict.fromkeys(range(request.sampling.n), 0)
        sent = 0
        while at:
            for index, i in list(at.items()):
                if self.fail_at is not None and sent >= self.fail_at:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is dying")
                out = self._output(index)
                last = i == len(out) - 1
                msg = worker_pb2.WorkerGenerateResponse(
                    first_index=i, token_ids=[out[i]], finish_reason=self.finish if last else "", index=index
                )
                _fake_logprobs(msg, request, remote)
                yield msg
                sent += 1
                if last:
                    del at[index]
                else:
                    at[index] = i + 1
                await asyncio.sleep(0)

    async def Prefill(self, request, context):
        self.metadata_ids.append(request_id_from_metadata(context.invocation_metadata()))
        self.requests.append(request)
        self.timeouts.append(context.time_remaining())
        self.active.add(request.request_id)
        self._note()
        try:
            if self.prefill_gate is not None:
                await self.prefill_gate.wait()
            self.prefilled.add(request.request_id)
            ticket = request.transfer_ticket or self.tickets.pop(request.request_id, b"")
            if self.transfers is not None and ticket:  # the "KV" moves once the prefill is done
                self.transfers.event(ticket).set()
            if self.prefill_metrics is not None:
                self.prefill_metrics.observe_prefill(1e-4, len(request.prompt_token_ids))
            if self.transfer_metrics is not None:  # the fake "transfers" one byte per prompt token
                self.transfer_metrics.add_bytes(len(request.prompt_token_ids))
                self.transfer_metrics.layer_done(1e-5)
                self.transfer_metrics.transfer_done(1e-4)
            if self.answer_gate is not None:
                await self.answer_gate.wait()
            n = request.sampling.n
            resp = worker_pb2.PrefillResponse(
                first_token_id=self._output(0)[0],
                cached_tokens=self.cached_tokens,
                transfer_bytes=len(request.prompt_token_ids),
                first_token_ids=[self._output(c)[0] for c in range(n)] if n > 1 else [],
            )
            if request.sampling.HasField("logprobs"):
                resp.first_logprobs.CopyFrom(_fake_entry(self._output(0)[0]))
                resp.choice_logprobs.extend(_fake_entry(self._output(c)[0]) for c in range(1, n))
            if request.sampling.HasField("prompt_logprobs"):
                resp.prompt_logprobs.extend(_fake_entry(t) for t in request.prompt_token_ids[1:])
            return resp
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            self._note()
            raise
        finally:
            self.active.discard(request.request_id)
            self._note()

    async def AttachTicket(self, request, context):
        """The ticket of a Prefill sent without one (empty: dropped); moves the fake's "transfer"."""
        self.attached.append((request.request_id, request.transfer_ticket))
        self._note()
        if self.attach_gate is not None:
            await self.attach_gate.wait()
        if self.transfers is not None and request.transfer_ticket:
            if request.request_id in self.prefilled:  # the prefill is done: the "KV" moves now
                self.transfers.event(request.transfer_ticket).set()
            else:  # it moves when the prefill is done (as a real prefill worker's transfer)
                self.tickets[request.request_id] = request.transfer_ticket
        return worker_pb2.Empty()

    async def GetLoad(self, request, context):
        return self.load()

    async def Drain(self, request, context):
        if self.shell is not None:
            self.shell.begin_drain()
        return self.load()

    def load(self) -> worker_pb2.WorkerLoad:
        state = self.shell.state.proto if self.shell is not None else worker_pb2.WORKER_STATE_LOADING
        if self.decode_metrics is not None:
            self.decode_metrics.set_kv_usage(len(self.active), self.kv_blocks_total)
        if self.prefill_metrics is not None:
            self.prefill_metrics.set_queue_tokens(0)
        return worker_pb2.WorkerLoad(
            worker_id=self.worker_id,
            state=state,
            running=len(self.active),
            kv_blocks_total=self.kv_blocks_total,
            prefill_tokens_per_s=self.prefill_rate,
        )

    async def start(self, router_address: str, **agent_kw) -> None:
        """Serve, register with the router (heartbeating in the background)."""
        self.shell = WorkerShell(ShellConfig(host=self.host, drain_timeout_s=10.0, stop_grace_s=0.1))
        address = await self.shell.start(lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(self, s))
        await self.shell.set_serving()
        info = worker_pb2.WorkerInfo(
            worker_id=self.worker_id,
            role=ROLE_TO_PROTO[self.role],
            address=address,
            kv_blocks_total=self.kv_blocks_total,
            block_size=self.block_size,
            max_running=self.max_running,
            pid=os.getpid(),
            context_length=self.context_length,
            kv_layout=self.kv_layout,
            tokenizer_digest=self.tokenizer_digest,
        )
        config = AgentConfig(router_address, **agent_kw)
        if "," in router_address:  # several routers: it joins every one
            self.agent = RouterSet(
                RouterSetConfig(router_address, config), info, self.load, self.shell.begin_drain
            )
        else:
            self.agent = RouterAgent(config, info, self.load, self.shell.begin_drain)
        await self.agent.register()
        self.agent.start()

    async def stop(self) -> None:
        self.release.set()
        for gate in (self.decode_gate, self.prefill_gate):
            if gate is not None:
                gate.set()
        if self.agent is not None:
            await self.agent.close()
        if self.shell is not None:
            await self.shell.stop()


# Tokens a fake worker started by the CLI generates (the test tokenizer's "hello world the cat").
CLI_TOKENS = (4, 5, 6, 7)  # ids("hello world the cat")


async def serve(args: WorkerArgs) -> None:
    """``pdserve worker --worker-module tests.fake_workers``: a fake worker as its own process.

    Requests whose id starts with "hold-" stop after output 0 until the worker drains, so a test
    can show that a drain waits for them.
    """
    w = FakeWorker(
        args.worker_id, args.role, CLI_TOKENS, block_size=args.block_size, max_running=args.max_running
    )
    w.transfers = None
    registry = process_registry(args.role.value, gpu=False)
    if args.role.decodes:
        w.decode_metrics = DecodeMetrics(registry, args.role.value)
    else:
        w.prefill_metrics = PrefillMetrics(registry)
        w.transfer_metrics = TransferMetrics(TransferRole.PREFILL, registry)
    endpoint = serve_metrics(registry, args.host, args.metrics_port)
    w.shell = WorkerShell(args.shell_config())
    address = await w.shell.start(lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(w, s))
    await w.shell.set_serving()

    def drain() -> None:
        w.shell.begin_drain()
        w.release.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, drain)
    info = args.worker_info(
        address,
        kv_blocks_total=w.kv_blocks_total,
        context_length=0,
        pid=os.getpid(),
        dtype=args.dtype,  # no model here: what was asked
        device=args.device,
        metrics_url=endpoint.url,
    )
    config = AgentConfig(args.router, register_timeout_s=30.0, cluster_token=args.cluster_token)
    w.agent = RouterAgent(config, info, w.load, drain)
    try:
        await run_worker(w.shell, w.agent)
    finally:
        endpoint.close()
