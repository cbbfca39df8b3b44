"""prefixlab: exact, fast prefix reuse for hybrid (attention + recurrent/SSM) LLMs."""

from prefixlab.errors import (
    CorruptStoreError,
    InvalidInputError,
    ModelMismatchError,
    PrefixlabError,
    StoreClosedError,
    TraceFormatError,
    UnsupportedModelError,
)

__version__ = "0.1.0"

__all__ = [
    "CorruptStoreError",
    "HybridPrefixCache",
    "InvalidInputError",
    "ModelMismatchError",
    "PrefixStore",
    "PrefixlabError",
    "StoreClosedError",
    "TraceFormatError",
    "UnsupportedModelError",
    "__version__",
    "patch",
    "unpatch",
]


_SUBPACKAGES = ("attention", "cache", "recurrent", "sim")


def __getattr__(name: str):
    # PrefixStore, HybridPrefixCache, patch and the subpackages pull in torch and transformers: import them on use.
    if name in ("PrefixStore", "HybridPrefixCache"):
        from prefixlab import cache

        return getattr(cache, name)
    if name in ("patch", "unpatch"):
        from prefixlab.cache import prepare

        return getattr(prepare, name)
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"prefixlab.{name}")
    raise AttributeError(f"module 'prefixlab' has no attribute {name!r}")
