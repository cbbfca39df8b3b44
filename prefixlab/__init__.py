"""prefixlab: exact, fast prefix reuse for hybrid (attention + recurrent/SSM) LLMs."""

from prefixlab.errors import (
    InvalidInputError,
    ModelMismatchError,
    PrefixlabError,
    TraceFormatError,
    UnsupportedModelError,
)

__version__ = "0.1.0"

__all__ = [
    "HybridPrefixCache",
    "InvalidInputError",
    "ModelMismatchError",
    "PrefixStore",
    "PrefixlabError",
    "TraceFormatError",
    "UnsupportedModelError",
    "__version__",
]


def __getattr__(name: str):
    # PrefixStore / HybridPrefixCache pull in torch and transformers: import them only when asked for.
    if name in ("PrefixStore", "HybridPrefixCache"):
        from prefixlab import cache

        return getattr(cache, name)
    raise AttributeError(f"module 'prefixlab' has no attribute {name!r}")
