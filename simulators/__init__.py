"""LLM search simulators: prompts, parsing, text backends, the simulator engine, a cache, serving, and the
simulator's SFT/DPO pipeline and quality report.

Components layer: independent of the other components (simulators, eval, curricula). May import ``zerosim.agent``,
``zerosim.core`` and third-party libraries; imported by the apps (``zerosim.engines`` and above).
"""

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
