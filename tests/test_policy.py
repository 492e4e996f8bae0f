"""The Python policy: which algorithm for which size and world, timeouts, env overrides."""
import pytest

from ringdp import policy


def test_threshold_depends_on_world(monkeypatch):
    monkeypatch.delenv("RINGDP_ALGO", raising=False)
    monkeypatch.delenv("RINGDP_ONESHOT_MAX_BYTES", raising=False)
    assert policy.choose_algo(4096, 2) == policy.ALGO_RING  # measured: ring wins at world 2
    assert policy.choose_algo(4096, 4) == policy.ALGO_ONESHOT
    assert policy.choose_algo(policy.ONESHOT_MAX_BYTES, 4) == policy.ALGO_ONESHOT
    assert policy.choose_algo(policy.ONESHOT_MAX_BYTES + 1, 4) == policy.ALGO_RING


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("RINGDP_ONESHOT_MAX_BYTES", "100")
    assert policy.choose_algo(100, 2) == policy.ALGO_ONESHOT
    assert policy.choose_algo(101, 4) == policy.ALGO_RING
    monkeypatch.setenv("RINGDP_ALGO", "ring")
    assert policy.choose_algo(1, 4) == policy.ALGO_RING
    monkeypatch.setenv("RINGDP_ALGO", "oneshot")
    assert policy.choose_algo(policy.oneshot_buffer_bytes(), 2) == policy.ALGO_ONESHOT
    assert policy.choose_algo(policy.oneshot_buffer_bytes() + 1, 2) == policy.ALGO_RING  # falls back
    monkeypatch.setenv("RINGDP_ALGO", "fast")
    with pytest.raises(ValueError, match="RINGDP_ALGO"):
        policy.choose_algo(1, 2)
    monkeypatch.setenv("RINGDP_ALGO", "auto")
    monkeypatch.setenv("RINGDP_ONESHOT_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="not an integer"):
        policy.choose_algo(1, 4)


def test_spin(monkeypatch):
    monkeypatch.setenv("RINGDP_SPIN_US", "7")
    assert policy.spin_ns(2) == 7000
    monkeypatch.delenv("RINGDP_SPIN_US")
    assert policy.spin_ns(10_000) == 2_000
