"""LLM search simulators."""

from simulators.llm import LLMSimulator
from simulators.parsing import split_documents
from simulators.prompts import SimulatorPrompts

__all__ = ["LLMSimulator", "SimulatorPrompts", "split_documents"]
