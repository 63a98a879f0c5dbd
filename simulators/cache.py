"""The search cache, kept in the foundation (:mod:`zerosim.core.search_cache`): imported from here as before."""

from zerosim.core.search_cache import (  # noqa: F401
    KEY_VERSION,
    CachedSearchEngine,
    cache_key,
    documents_from_json,
    documents_to_json,
)

__all__ = ["KEY_VERSION", "CachedSearchEngine", "cache_key", "documents_from_json", "documents_to_json"]
