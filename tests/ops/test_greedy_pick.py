"""ops.greedy_pick: the one-launch greedy pick and advance against torch's argmax and index ops, exactly
(ties, NaN, -inf rows, rows past one reduction block, vocabularies that end inside a chunk), and its argument
errors."""

from __future__ import annotations

import pytest
import torch

from sparseffn.kernels.greedy_pick import BLOCK_V
from sparseffn.ops.greedy_pick import advance_greedy_, advance_greedy_reference, greedy_scratch

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _state(b: int, length: int = 12, start: int = 5):
    out = torch.arange(b * length, dtype=torch.long, device=DEVICE).reshape(b, length)
    ids = torch.full((b, 1), -1, dtype=torch.long, device=DEVICE)
    position = torch.tensor([start], dtype=torch.long, device=DEVICE)
    return out, ids, position


def _both(logits: torch.Tensor, calls: int = 1):
    """(kernel's state, torch's state) after `calls` calls on the same logits, and the scratch's counter."""
    got, want = _state(logits.shape[0]), _state(logits.shape[0])
    scratch = greedy_scratch(*logits.shape, logits.device)
    for _ in range(calls):
        advance_greedy_(logits, *got, scratch)
        advance_greedy_reference(logits, *want)
    return got, want, scratch[2]


def _assert_same(got, want, counter):
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert int(counter) == 0  # left zero for the next call


@pytest.mark.parametrize("b,v", [(1, 5), (3, BLOCK_V), (2, BLOCK_V + 1), (17, 2 * BLOCK_V + 333)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pick_and_advance_equal_torchs(b, v, dtype):
    g = torch.Generator().manual_seed(b * 7 + v)
    logits = torch.randn(b, v, generator=g).to(dtype).to(DEVICE)
    got, want, counter = _both(logits, calls=2)  # the second call finds the counter zero again
    _assert_same(got, want, counter)
    assert int(got[2]) == 7


def test_ties_nan_and_minus_inf_rows_follow_torch_argmax():
    """Ties across and within chunks give the first index; a row with NaN gives its first NaN, even after a
    +inf; a row of -inf gives index 0; every case's chunk sits away from chunk 0."""
    v = 3 * BLOCK_V + 10
    logits = torch.zeros(6, v)
    logits[0, [BLOCK_V + 3, 2 * BLOCK_V + 1, 3 * BLOCK_V + 9]] = 5.0  # ties in three chunks
    logits[1, [BLOCK_V + 8, BLOCK_V + 2]] = 2.0  # ties in one chunk
    logits[2, [10, 2 * BLOCK_V + 4]] = float("nan")
    logits[2, 1] = float("inf")
    logits[3, [3 * BLOCK_V + 5, BLOCK_V + 7]] = float("nan")
    logits[4] = float("-inf")
    logits[5, v - 1] = 1.0  # the last column
    for dtype in (torch.bfloat16, torch.float32):
        got, want, counter = _both(logits.to(dtype).to(DEVICE))
        _assert_same(got, want, counter)
        assert got[1][:, 0].tolist() == [BLOCK_V + 3, BLOCK_V + 2, 10, BLOCK_V + 7, 0, v - 1]


def test_argument_errors_name_the_argument():
    logits = torch.randn(2, 10, device=DEVICE)
    out, ids, position = _state(2)
    scratch = greedy_scratch(2, 10, logits.device)
    with pytest.raises(ValueError, match="logits must be a"):
        advance_greedy_(logits.long(), out, ids, position, scratch)
    with pytest.raises(ValueError, match="logits must have a vocabulary of unit stride"):
        advance_greedy_(torch.randn(10, 2, device=DEVICE).t(), out, ids, position, scratch)
    with pytest.raises(ValueError, match=r"ids must be an int64 tensor of shape \[2, 1\]"):
        advance_greedy_(logits, out, ids.int(), position, scratch)
    with pytest.raises(ValueError, match=r"out must be an int64 tensor of shape \[2, 'L'\]"):
        advance_greedy_(logits, out[:1], ids, position, scratch)
    with pytest.raises(ValueError, match=r"position must be"):
        advance_greedy_(logits, out, ids, position.expand(2), scratch)
    with pytest.raises(ValueError, match=r"scratch must be greedy_scratch\(2, 10"):
        advance_greedy_(logits, out, ids, position, greedy_scratch(2, 10 + BLOCK_V, logits.device))
