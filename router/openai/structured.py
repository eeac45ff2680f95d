"""The OpenAI front's structured-output options onto ``pdserve.v1.StructuredOutputs``. Pure: no grpc.

OpenAI's ``response_format`` (``json_object``, ``json_schema``) and vLLM's ``structured_outputs`` and
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` become one constraint, checked
here so that an error names the field the client sent.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.engine.structured import StructuredOutputsParams, check_compiles
from pdserve.proto import generation_pb2 as g
from pdserve.router.openai.protocol import invalid, present
from pdserve.worker.convert import structured_outputs_to_proto

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# vLLM's structured_outputs keys pdserve takes (the rest, such as structural_tag, are refused by name).
_VLLM_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _raw(value: msgspec.Raw) -> Any:
    return msgspec.json.decode(bytes(value)) if present(value) else None


def spec_or_400(field: str, **kw: Any) -> StructuredOutputsParams:
    """A constraint, built and compile-checked; a 400 naming ``field`` when it is not one."""
    try:
        spec = StructuredOutputsParams(**kw)
        check_compiles(spec)
    except ValueError as e:
        raise invalid(f"{field}: {e}".replace("structured_outputs.", ""), field) from None
    return spec


def _response_format(fmt: Any) -> StructuredOutputsParams | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str | None):
        raise invalid("response_format must be an object with a type", "response_format")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return spec_or_400("response_format", json_object=True)
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name"), str) or not js.get("name"):
            raise invalid("response_format.json_schema must be an object with a name", "response_format")
        schema = js.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise invalid(
                "response_format.json_schema.schema must be a JSON schema (an object)", "response_format"
            )
        return spec_or_400("response_format", json=schema)
    raise invalid(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}", "response_format"
    )


def structured_outputs_of(req: Any) -> g.StructuredOutputs | None:
    """The request's one constraint (None: free text). Two ways of asking for one are a 400."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if present(req.response_format):
        spec = _response_format(_raw(req.response_format))
        if spec is not None:
            found.append(("response_format", spec))
    for name, key in _GUIDED.items():
        value = _raw(getattr(req, name))
        if value is not None:
            found.append((name, spec_or_400(name, **{key: value})))
    so = _raw(req.structured_outputs)
    if so is not None:
        if not isinstance(so, dict):
            raise invalid("structured_outputs must be an object", "structured_outputs")
        extra = sorted(k for k, v in so.items() if k not in _VLLM_KEYS and v not in (None, False))
        if extra:
            raise invalid(f"structured_outputs: {', '.join(extra)} is not supported", "structured_outputs")
        kw = {k: so[k] for k in _VLLM_KEYS if so.get(k) not in (None, False)}
        found.append(("structured_outputs", spec_or_400("structured_outputs", **kw)))
    if len(found) > 1:
        names = " and ".join(n for n, _ in found)
        raise invalid(f"{names} both constrain the output: give one", found[1][0])
    return structured_outputs_to_proto(found[0][1]) if found else None
