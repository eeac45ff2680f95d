"""pdserve's model runtime: ``from pdserve.engine import LLM, SamplingParams``.

Names resolve lazily (PEP 562), so ``import pdserve.engine`` loads neither torch nor a model and the
pure modules (block manager, scheduler, params) stay cheap for the router to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "pdserve.engine.llm",
    "RequestOutput": "pdserve.engine.llm",
    "SamplingParams": "pdserve.engine.params",
    "StructuredOutputsParams": "pdserve.engine.structured",
    "LLMEngine": "pdserve.engine.llm_engine",
    "EngineConfig": "pdserve.engine.llm_engine",
    "RequestOutputDelta": "pdserve.engine.llm_engine",
    "CompletionOutput": "pdserve.engine.llm",
}

__all__ = [
    "EngineConfig",
    "LLM",
    "LLMEngine",
    "RequestOutput",
    "RequestOutputDelta",
    "SamplingParams",
    "StructuredOutputsParams",
    "CompletionOutput",
]

if TYPE_CHECKING:
    from pdserve.engine.llm import LLM, CompletionOutput, RequestOutput
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine, RequestOutputDelta
    from pdserve.engine.params import SamplingParams
    from pdserve.engine.structured import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
