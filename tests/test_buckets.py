"""Bucket assignment (single process): which gradients share a bucket, in which order."""
import torch

from ringdp.buckets import assign_buckets


def test_assign_buckets_rules():
    f32, f16 = (torch.float32, "cpu"), (torch.float16, "cpu")
    nbytes = [100, 100, 100, 100, 100, 100]
    keys = [f32, f32, f16, f32, f16, f32]
    order = list(reversed(range(6)))  # 5 4 3 2 1 0
    b = assign_buckets(order, nbytes, keys, cap_bytes=250, first_cap_bytes=100)
    # f32 tensors 5,3,1,0: first bucket (cap 100) = [5], then [3,1,0] reaches 300 >= 250 at 0
    # f16 tensors 4,2: first bucket [4] (100 >= 100), then [2] left open
    assert b == [[5], [4], [3, 1, 0], [2]]
    # every tensor once, one dtype per bucket
    assert sorted(i for bk in b for i in bk) == list(range(6))
    assert all(len({keys[i] for i in bk}) == 1 for bk in b)
    # a tensor larger than the cap gets a bucket of its own
    assert assign_buckets([0, 1, 2], [10, 1000, 10], [f32] * 3, 100, 100) == [[0, 1], [2]]
    # in_grad_bytes: a gradient reduced in its .grad closes the open bucket and stands alone
    assert assign_buckets([0, 1, 2, 3], [10, 1000, 10, 10], [f32] * 4, 100, 100, in_grad_bytes=500) == [[0], [1], [2, 3]]
