"""Prefix caches: the policy core (core.py) and its tensor side for Hugging Face models (store.py, hf.py)."""

__all__ = ["HybridPrefixCache", "PrefixStore"]


def __getattr__(name: str):
    # the tensor side imports torch and transformers; the simulator only needs the core
    if name == "PrefixStore":
        from prefixlab.cache.store import PrefixStore

        return PrefixStore
    if name == "HybridPrefixCache":
        from prefixlab.cache.hf import HybridPrefixCache

        return HybridPrefixCache
    raise AttributeError(f"module 'prefixlab.cache' has no attribute {name!r}")
