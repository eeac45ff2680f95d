"""Conversions between the wire (protobuf) and the engine's types, shared by the router and every pool.

The router validates a request with these and the workers rebuild it with the same ones, so a request
the router accepts is one the workers accept.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from pdserve.engine.params import SamplingParams
from pdserve.engine.structured import StructuredOutputsParams
from pdserve.proto import generation_pb2, worker_pb2
from pdserve.worker.role import Role

if TYPE_CHECKING:  # (the router imports this module: no torch at run time)
    from pdserve.engine.logprobs import TokenLogprob

# proto3 optional fields copied into SamplingParams when set; unset ones keep the engine defaults.
_OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "min_tokens",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "n",
    "speculative",
)
_LOGPROB_FIELDS = ("logprobs", "prompt_logprobs")
ROLE_TO_PROTO = {
    Role.PREFILL: worker_pb2.ROLE_PREFILL,
    Role.DECODE: worker_pb2.ROLE_DECODE,
    Role.BOTH: worker_pb2.ROLE_BOTH,
}


def sampling_params_from_proto(s: generation_pb2.SamplingParams) -> SamplingParams:
    """Build the engine's SamplingParams; its ValueError names the field."""
    kw: dict[str, object] = {f: getattr(s, f) for f in _OPTIONAL_FIELDS if s.HasField(f)}
    if s.logit_bias:
        kw["logit_bias"] = s.logit_bias  # (a mapping: SamplingParams checks its size before reading it)
    kw.update({f: getattr(s, f) for f in _LOGPROB_FIELDS if s.HasField(f)})
    if s.HasField("structured_outputs"):
        kw["structured_outputs"] = structured_outputs_from_proto(s.structured_outputs)
    return SamplingParams(stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids), **kw)  # type: ignore[arg-type]


def logprobs_to_proto(entries: Iterable[TokenLogprob]) -> list[generation_pb2.TokenLogprobs]:
    """The engine's ``TokenLogprob`` entries as the wire carries them."""
    return [
        generation_pb2.TokenLogprobs(
            token_id=e.token_id, logprob=e.logprob, top_token_ids=e.top_ids, top_logprobs=e.top_logprobs
        )
        for e in entries
    ]


def structured_outputs_from_proto(so: generation_pb2.StructuredOutputs) -> StructuredOutputsParams:
    kind = so.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_outputs is set but holds no constraint")
    if kind == "choice":
        return StructuredOutputsParams(choice=tuple(so.choice.choices))
    return StructuredOutputsParams(**{kind: getattr(so, kind)})


def structured_outputs_to_proto(spec: StructuredOutputsParams) -> generation_pb2.StructuredOutputs:
    so = generation_pb2.StructuredOutputs()
    if spec.choice is not None:
        so.choice.choices.extend(spec.choice)
    else:
        setattr(so, spec.kind.value, getattr(spec, spec.kind.value))
    return so


# gRPC metadata the router sends with every worker call: the request's id, as clients, proxies and
# traces know it (the same value as the message's request_id field).
REQUEST_ID_METADATA_KEY = "x-request-id"


def request_id_metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    return ((REQUEST_ID_METADATA_KEY, request_id),)


def request_id_from_metadata(metadata) -> str:
    """The ``x-request-id`` of a call's invocation metadata ("" when absent)."""
    for key, value in metadata or ():
        if key == REQUEST_ID_METADATA_KEY:
            return value if isinstance(value, str) else value.decode()
    return ""
