"""Foundation layer: what every other part stands on, knowing nothing of agents, training or experiments.

The ``SearchEngine`` protocol and documents (``search``), QA metrics, data loading (``data/``), models and
the chat-template encoder, generation and decoding, MLflow helpers (``tracking``), the HTTP client, retry
transport and generic engine server (``http/``), the LLM judge client, atomic writes, runtime and
distributed helpers, and the config loader (``config``).

May import: only itself and third-party libraries. Everything else in the project may import it.
"""
