"""The choices of one OpenAI response as it is built: each choice's own text, logprobs, echo and tool calls
(``n`` > 1: every response message is one choice's, by its ``index``). Pure: protobuf messages, no grpc.

The prompt's logprobs come once, on the request's first message; with echo every choice shows them at the
head of its own, as every choice's text starts with the prompt (OpenAI's shape).
"""

from __future__ import annotations

from pdserve.proto import generation_pb2 as g
from pdserve.router.openai.logprobs import ResponseOptions, chat_logprobs, completion_logprobs
from pdserve.router.openai.protocol import ChatChoice, ChatMessageOut, CompletionChoice
from pdserve.router.openai.tools import ToolCallStream, ToolPlan


class ChoiceState:
    """What one choice has shown (streaming) or gathered (a whole body) so far."""

    __slots__ = ("role_sent", "echoed", "pending", "text_offset", "calls", "text", "finish")

    def __init__(self, tools: ToolPlan | None, streaming: bool) -> None:
        self.role_sent = False
        self.echoed = False
        # Logprobs not shown yet (streaming: waiting with their tokens' held-back text; a body: all).
        self.pending: list[g.TokenLogprobs] = []
        self.text_offset = 0
        # Streaming with tools: text that may be a tool call is held back until it is known.
        self.calls = ToolCallStream(tools) if tools is not None and streaming else None
        self.text: list[str] = []  # a body's text
        self.finish: str | None = None

    def take_pending(self) -> list[g.TokenLogprobs]:
        entries, self.pending = self.pending, []
        return entries

    def echo(self, text: str, opts: ResponseOptions) -> str:
        """``text`` with the prompt's in front on the choice's first chunk, when echo is on."""
        if opts.echo is not None and not self.echoed:
            self.echoed = True
            return opts.echo + text
        return text


class Choices:
    """Each choice's state by index, made on its first message."""

    __slots__ = ("by_index", "_tools", "_streaming", "_prompt_logprobs")

    def __init__(self, options: ResponseOptions | None, tools: ToolPlan | None, streaming: bool) -> None:
        self.by_index: dict[int, ChoiceState] = {}
        self._tools, self._streaming = tools, streaming
        # Echo with logprobs: the prompt's, which head every choice's logprobs.
        self._prompt_logprobs: list[g.TokenLogprobs] | None = (
            [] if options is not None and options.echo is not None and options.logprobs is not None else None
        )

    def of(self, msg: g.GenerateResponse, logprobs: bool) -> ChoiceState:
        """The state of ``msg``'s choice, with the message's logprobs added to its pending ones when
        ``logprobs``."""
        prompt = self._prompt_logprobs
        if prompt is not None and msg.prompt_logprobs:
            prompt[:] = msg.prompt_logprobs
        st = self.by_index.get(msg.index)
        if st is None:
            st = self.by_index[msg.index] = ChoiceState(self._tools, self._streaming)
            if prompt is not None:
                st.pending.extend(prompt)
        if logprobs:
            st.pending.extend(msg.logprobs)
        if msg.finish_reason:
            st.finish = msg.finish_reason
        return st

    def finish(self, index: int) -> str | None:
        st = self.by_index.get(index)
        return None if st is None else st.finish

    def indices(self) -> list[int]:
        return sorted(self.by_index) or [0]


def completion_choice(index: int, st: ChoiceState | None, opts: ResponseOptions) -> CompletionChoice:
    """A whole body's choice of ``/v1/completions``."""
    st = st or ChoiceState(None, False)
    text = st.echo("".join(st.text), opts)
    lps = None if opts.logprobs is None else completion_logprobs(st.pending, opts.token_text)
    return CompletionChoice(index=index, text=text, logprobs=lps, finish_reason=st.finish)


def chat_choice(
    index: int, st: ChoiceState | None, opts: ResponseOptions, tools: ToolPlan | None
) -> ChatChoice:
    """A whole body's choice of ``/v1/chat/completions``: its text, or the tool calls it made."""
    st = st or ChoiceState(None, False)
    text = "".join(st.text)
    calls = tools.calls(text) if tools is not None and st.finish == "stop" else None
    if calls:
        return ChatChoice(
            index=index,
            message=ChatMessageOut(None, "assistant", calls),
            logprobs=None,
            finish_reason="tool_calls",
        )
    logprobs = None if opts.logprobs is None else chat_logprobs(st.pending, opts.token_text)
    return ChatChoice(
        index=index, message=ChatMessageOut(text, "assistant"), logprobs=logprobs, finish_reason=st.finish
    )
