import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU and ringdp built with CUDA (skipped otherwise)")
