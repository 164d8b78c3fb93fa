import pytest

from tests.models.helpers import one_thread_fixture


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The tiny model runs ~100x faster on one thread on a shared 2-core machine (see tests/models/helpers.py)."""
    yield from one_thread_fixture()
