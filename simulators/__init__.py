"""LLM search simulators: prompts, parsing, text backends, the simulator engine, a cache, serving."""

from simulators.backends import OpenAIBackend, TextBackend, TransformersBackend
from simulators.cache import CachedSearchEngine
from simulators.llm import LLMSimulator
from simulators.parsing import split_documents
from simulators.prompts import SimulatorPrompts, load_prompts

__all__ = [
    "CachedSearchEngine",
    "LLMSimulator",
    "OpenAIBackend",
    "SimulatorPrompts",
    "TextBackend",
    "TransformersBackend",
    "load_prompts",
    "split_documents",
]
