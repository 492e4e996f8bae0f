"""The extension says what it was built with."""
import torch

import ringdp


def test_build_info():
    info = ringdp.build_info()
    assert info["version"] == ringdp.__version__
    assert "shm" in info["transports"]
    assert isinstance(info["cuda"], bool)
    assert ("cuda_ipc" in info["transports"]) == info["cuda"]
    # built against the torch that is running (a mismatch would be an ABI hazard)
    assert torch.__version__.startswith(info["built_with_torch"])
    assert info["compiler"]
