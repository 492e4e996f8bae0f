"""The ring schedule itself (csrc/ring), replayed as a dataflow for n up to 16."""
from collections import deque

import numpy as np
import pytest

from ringdp import _C


@pytest.mark.parametrize("n", list(range(1, 17)))
@pytest.mark.parametrize("align", [1, 4])
def test_chunks_tile_the_round(n, align):
    for count in [0, 1, 2, n - 1, n, n + 1, 3 * n + 2, 97, 1000]:
        if count < 0:
            continue
        ends = [(_C.chunk_begin(count, n, align, c), _C.chunk_end(count, n, align, c)) for c in range(n)]
        assert ends[0][0] == 0 and ends[-1][1] == count
        for (b0, e0), (b1, e1) in zip(ends, ends[1:]):
            assert e0 == b1 and b0 <= e0
        sizes = [e - b for b, e in ends]
        stride = -(-(-(-count // n)) // align) * align  # ceil(count/n) rounded up to align
        nonempty = [x for x in sizes if x]
        assert all(x == stride for x in nonempty[:-1]) and all(0 < x <= stride for x in nonempty[-1:])
        assert sizes == nonempty + [0] * (n - len(nonempty))  # empty chunks only at the end
        assert all(b % align == 0 for b, e in ends if e > b)


@pytest.mark.parametrize("n", list(range(2, 17)))
def test_step_chunks(n):
    for r in range(n):
        prev = (r - 1) % n
        for k in range(n - 1):
            # what I receive at step k is what my predecessor sent at step k
            assert _C.rs_recv_chunk(n, r, k) == _C.rs_send_chunk(n, prev, k)
            assert _C.ag_recv_chunk(n, r, k) == _C.ag_send_chunk(n, prev, k)
        assert _C.owned_chunk(n, r) == _C.rs_recv_chunk(n, r, n - 2)
        # all-gather starts with the chunk I own; I receive every chunk except my own
        assert _C.ag_send_chunk(n, r, 0) == _C.owned_chunk(n, r)
        got = {_C.ag_recv_chunk(n, r, k) for k in range(n - 1)}
        assert got == set(range(n)) - {_C.owned_chunk(n, r)}


def replay(count, n, slice_elems, align):
    """Run every rank's recorded primitives against FIFOs; rank r contributes 2**r."""
    traces = [deque(_C.ring_trace(count, n, r, slice_elems, align)) for r in range(n)]
    data = [np.full(count, 2 ** r, dtype=np.int64) for r in range(n)]
    fifo = [deque() for _ in range(n)]  # fifo[r]: messages from r to r+1
    sent = [0] * n
    progress = True
    while progress:
        progress = False
        for r in range(n):
            while traces[r]:
                prim, off, cnt = traces[r][0]
                src = fifo[(r - 1) % n]
                needs_in = prim.startswith("recv")
                if needs_in and not src:
                    break
                traces[r].popleft()
                progress = True
                if prim == "finish":
                    continue
                mine = data[r][off:off + cnt]
                if needs_in:
                    (o2, c2, payload) = src.popleft()
                    assert (o2, c2) == (off, cnt), (prim, r, off, cnt, o2, c2)
                if prim == "send":
                    out = mine.copy()
                elif prim == "recv_reduce_send":
                    out = payload + mine
                elif prim == "recv_reduce_copy_send":
                    out = payload + mine
                    data[r][off:off + cnt] = out
                elif prim == "recv_copy_send":
                    out = payload.copy()
                    data[r][off:off + cnt] = out
                else:  # recv
                    data[r][off:off + cnt] = payload
                    out = None
                if out is not None:
                    fifo[r].append((off, cnt, out))
                    sent[r] += 1
    assert all(not t for t in traces), "a rank is stuck waiting for data that never comes"
    assert all(not f for f in fifo), "a message was sent that nobody received"
    return data, sent


@pytest.mark.parametrize("n", list(range(1, 17)))
def test_replay_gives_full_sum_everywhere(n):
    for count, slice_elems, align in [(0, 4, 1), (1, 4, 1), (n - 1 if n > 1 else 0, 2, 1), (97, 3, 1),
                                      (1000, 16, 4), (1009, 64, 16)]:
        data, sent = replay(count, n, slice_elems, align)
        for r in range(n):
            assert (data[r] == 2 ** n - 1).all(), (n, count, r)
        if n > 1 and count:
            rounds = -(-count // (slice_elems * n))
            assert sent == [rounds * 2 * (n - 1)] * n  # 2(n-1) slices per rank per round


def test_half_conversions():
    for v in [0.0, 1.0, -2.5, 65504.0, 6.1e-5, 5.96e-8, 1e-9, 3.14159]:
        import torch

        assert _C.half_roundtrip(v) == float(torch.tensor(v).half().float())
        assert _C.bf16_roundtrip(v) == float(torch.tensor(v).bfloat16().float())
