"""Function calling for chat templates without a tool format: pdserve's generic convention. Pure Python.

A model whose chat template renders ``tools`` gets them in its own format. Others (SmolLM2's template has
none) get a system message that lists the functions and asks for a call as one JSON object,
``{"name": <function>, "arguments": {...}}``, the shape most instruction-tuned models produce when asked;
a function's result (a ``tool`` message) is shown to them as a user message. ``tool_call_schema`` is the
JSON schema of such a call, which structured output enforces when a call is required.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TOOL_ROLE = "tool"


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call: OpenAI's ``{"type": "function", "function": {...}}``."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] | None = None  # the arguments' JSON schema

    def as_openai(self) -> dict[str, Any]:
        """The shape chat templates with a tool format take (transformers' convention)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = dict(self.parameters) if self.parameters is not None else {"type": "object"}
        return {"type": "function", "function": fn}


def _listing(tools: Sequence[ToolSpec]) -> str:
    lines = [
        "You can call functions. Each line below is one function: its name, what it does, and the JSON "
        "schema of its arguments.",
    ]
    for t in tools:
        entry: dict[str, Any] = {"name": t.name}
        if t.description:
            entry["description"] = t.description
        entry["parameters"] = dict(t.parameters) if t.parameters is not None else {"type": "object"}
        lines.append(json.dumps(entry, ensure_ascii=False))
    lines.append(
        'To call a function, answer with only a JSON object, {"name": <the function\'s name>, "arguments": '
        "<its arguments as a JSON object>}, and nothing else. Otherwise answer as usual."
    )
    return "\n".join(lines)


def generic_tool_messages(
    messages: Sequence[Mapping[str, str]], tools: Sequence[ToolSpec], keep_tool_role: bool = False
) -> list[dict[str, str]]:
    """``messages`` with the functions listed in the system message (a new first one when there is none)
    and each ``tool`` message turned into a user message that says it is a function's result (unless
    ``keep_tool_role``)."""
    out = [dict(m) for m in messages]
    for m in out:
        if m.get("role") == TOOL_ROLE and not keep_tool_role:
            m["role"] = "user"
            m["content"] = f"The function returned: {m.get('content', '')}"
    if tools:
        listing = _listing(tools)
        if out and out[0].get("role") == "system":
            out[0]["content"] = f"{out[0].get('content', '')}\n\n{listing}".lstrip()
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def tool_call_text(name: str, arguments: str) -> str:
    """A call as the generic convention writes it (an assistant message of the history); ``arguments`` is
    the JSON text the client has (OpenAI sends it as a string)."""
    try:
        args: Any = json.loads(arguments) if arguments else {}
    except ValueError:
        args = arguments
    return json.dumps({"name": name, "arguments": args}, ensure_ascii=False)


def tool_call_schema(tools: Sequence[ToolSpec]) -> dict[str, Any]:
    """The JSON schema of one call to any of ``tools`` (one tool: a call to that one)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.name},
                "arguments": dict(t.parameters) if t.parameters is not None else {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}
