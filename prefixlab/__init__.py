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
    "InvalidInputError",
    "ModelMismatchError",
    "PrefixlabError",
    "TraceFormatError",
    "UnsupportedModelError",
    "__version__",
]
