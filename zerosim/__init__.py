"""zerosim: train LLM search agents against a simulated search engine."""

__version__ = "0.1.0"
