import pytest

from prefixlab.data import shared_file


def require_shared(relative: str):
    """Path of a shared data file, or skip the test with a clear reason."""
    path = shared_file(relative)
    if path is None:
        pytest.skip(f"../shared/data/{relative} not present (set PREFIXLAB_SHARED_DATA to run this test)")
    return path
