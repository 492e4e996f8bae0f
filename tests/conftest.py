import os
import sys

import pytest

# Test modules import the harness as `_dist`; spawned ranks inherit this sys.path, so they
# can import a test module by name and run the cases it passes by reference.
sys.path.insert(0, os.path.dirname(__file__))

from _dist import CASE_TIMEOUT_S, POOL_WORLD, PoolKeeper  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU and ringdp built with CUDA (skipped otherwise)")


@pytest.fixture(scope="module")
def _pool_keeper():
    keeper = PoolKeeper(POOL_WORLD, timeout=CASE_TIMEOUT_S)
    yield keeper
    keeper.close()


@pytest.fixture
def pool(_pool_keeper):
    """A pool of POOL_WORLD (2) ranks shared by the tests of one module, started on first use
    and replaced after a case left it hung or dead: `pool.run(case, **kwargs)`."""
    return _pool_keeper.get()
