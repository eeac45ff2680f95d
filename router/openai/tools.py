"""Chat completions' ``tools`` and ``tool_choice``: what the request asks, and the output's calls. Pure.

The functions travel to the router with the messages (``pdserve.v1.Tool``), where the chat template (or
pdserve's generic format, ``engine.tools``) renders them. ``required`` and a named function are enforced
by structured output: the JSON schema of one call (``engine.tools.tool_call_schema``). The output is read
as calls when it is one JSON object (or a list of them) naming a listed function, OpenAI's ``tool_calls``
with finish reason ``tool_calls``; ``ToolCallStream`` does the same for a stream, holding text back only
while it may still be a call.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from pdserve.engine.structured import MAX_STRUCTURED_OUTPUT_BYTES
from pdserve.engine.tools import ToolSpec, tool_call_schema
from pdserve.proto import generation_pb2 as g
from pdserve.router.openai.protocol import FunctionCall, ToolCall, invalid, present
from pdserve.router.openai.structured import spec_or_400
from pdserve.worker.convert import structured_outputs_to_proto

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # OpenAI's function names (with vLLM's "." and ":")


class ToolChoice(enum.Enum):
    NONE = "none"  # the tools are not shown and the output is text
    AUTO = "auto"  # the model may call one: output that is a call is read as one
    REQUIRED = "required"  # the output is a call to one of the tools (enforced)
    NAMED = "named"  # the output is a call to this one (enforced)


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[ToolSpec, ...]
    choice: ToolChoice
    named: str = ""

    @property
    def forced(self) -> tuple[ToolSpec, ...]:
        """The tools the output must call one of (none: not enforced)."""
        if self.choice is ToolChoice.REQUIRED:
            return self.tools
        if self.choice is ToolChoice.NAMED:
            return tuple(t for t in self.tools if t.name == self.named)
        return ()

    def to_proto(self) -> list[g.Tool]:
        return [
            g.Tool(
                name=t.name,
                description=t.description,
                parameters="" if t.parameters is None else json.dumps(t.parameters, ensure_ascii=False),
            )
            for t in self.tools
        ]

    def constraint(self) -> g.StructuredOutputs | None:
        forced = self.forced
        if not forced:
            return None
        return structured_outputs_to_proto(spec_or_400("tools", json=tool_call_schema(forced)))

    def calls(self, text: str) -> list[ToolCall] | None:
        """The output's calls, or None when it is not (only) calls to the listed tools."""
        if self.choice is ToolChoice.NONE:
            return None
        return parse_tool_calls(text, {t.name for t in self.tools})


def _raw(value: msgspec.Raw) -> Any:
    return msgspec.json.decode(bytes(value)) if present(value) else None


def _tool(i: int, item: Any) -> ToolSpec:
    where = f"tools[{i}]"
    if not isinstance(item, dict) or item.get("type", "function") != "function":
        raise invalid(f"{where} must be an object of type function", "tools")
    fn = item.get("function")
    if not isinstance(fn, dict):
        raise invalid(f"{where}.function must be an object", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}", "tools")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise invalid(f"{where}.function.description must be a string", "tools")
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise invalid(f"{where}.function.parameters must be a JSON schema (an object)", "tools")
        size = len(json.dumps(params).encode())
        if size > MAX_STRUCTURED_OUTPUT_BYTES:
            raise invalid(
                f"{where}.function.parameters has {size:,} bytes; at most {MAX_STRUCTURED_OUTPUT_BYTES:,}",
                "tools",
            )
    return ToolSpec(name, description, params)


def tool_plan(tools_raw: msgspec.Raw, choice_raw: msgspec.Raw) -> ToolPlan | None:
    """What ``tools`` and ``tool_choice`` ask for (None: no tools). A 400 naming the field otherwise."""
    items = _raw(tools_raw)
    choice = _raw(choice_raw)
    if items is None:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(items, list):
        raise invalid("tools must be a list of functions", "tools")
    if len(items) > MAX_TOOLS:
        raise invalid(f"tools has {len(items)} functions; at most {MAX_TOOLS}", "tools")
    tools = tuple(_tool(i, item) for i, item in enumerate(items))
    if len({t.name for t in tools}) != len(tools):
        raise invalid("tools has two functions of the same name", "tools")
    if choice is None or choice == "auto":
        return ToolPlan(tools, ToolChoice.AUTO)
    if choice in ("none", "required"):
        return ToolPlan(tools, ToolChoice(choice))
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not any(t.name == name for t in tools):
            raise invalid(f"tool_choice names {name!r}, which is not among tools", "tool_choice")
        return ToolPlan(tools, ToolChoice.NAMED, str(name))
    raise invalid(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def _call(obj: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    arguments = json.dumps(args, ensure_ascii=False)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(obj["name"], arguments))


def parse_tool_calls(text: str, names: set[str]) -> list[ToolCall] | None:
    """``text`` as calls: one ``{"name": ..., "arguments": {...}}`` object or a list of them, each naming
    one of ``names``. None when it is anything else."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    objs = value if isinstance(value, list) else [value]
    calls = [_call(o, names) for o in objs]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


class ToolCallStream:
    """A streamed chat's text, held back while it may be a call: ``feed`` gives the text that is content
    for sure; ``finish`` the calls (or the held text, when it was none)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._held: list[str] = []
        # Enforced: the output is a call. Otherwise it may be one until its first non-space character says
        # it is not (a call opens with "{" or "[").
        self._maybe = plan.choice is not ToolChoice.NONE

    def feed(self, text: str) -> str:
        if not self._maybe:
            return text
        self._held.append(text)
        head = "".join(self._held).lstrip()
        if self.plan.forced or not head or head[0] in "{[":
            return ""
        self._maybe = False
        held, self._held = "".join(self._held), []
        return held

    def finish(self) -> tuple[str, list[ToolCall] | None]:
        """At the end: (text still held, calls). The calls are None when the held text is not calls."""
        held, self._held = "".join(self._held), []
        if not self._maybe:
            return held, None
        calls = self.plan.calls(held)
        return ("", calls) if calls else (held, None)
