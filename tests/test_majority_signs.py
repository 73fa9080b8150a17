"""``lioncub.ops.packing.majority_signs`` / ``margin_signs`` (the hierarchical and node-majority votes'
final rule) against the closed form in numpy: ``sign(2·c − N)``, a tie going to ±1 by the tie rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lioncub.ops import packing


def _reference(counts: np.ndarray, n: int, tie: int | None) -> np.ndarray:
    margin = 2 * counts.astype(np.int64) - n
    out = np.sign(margin)
    if tie is not None:
        out[margin == 0] = tie
    return out.astype(np.int8)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32])
def test_every_count_of_every_n(dtype: torch.dtype) -> None:
    for n in range(1, 128 if dtype == torch.int8 else 256):  # an int8 count holds N <= 127
        counts = np.arange(n + 1)
        t = torch.from_numpy(counts).to(dtype)
        for tie_positive in (True, False):
            got = packing.majority_signs(t, n, tie_positive)
            assert got.dtype == torch.int8
            np.testing.assert_array_equal(got.numpy(), _reference(counts, n, 1 if tie_positive else -1))
        got = packing.margin_signs(t, n)
        assert got.dtype == torch.int8
        np.testing.assert_array_equal(got.numpy(), _reference(counts, n, None))


@given(
    n=st.integers(1, 255),
    data=st.data(),
    tie_positive=st.booleans(),
)
def test_random_counts_agree_with_pack_majority(n: int, data: st.DataObject, tie_positive: bool) -> None:
    counts = np.array(data.draw(st.lists(st.integers(0, n), max_size=300)), dtype=np.int32)
    t = torch.from_numpy(counts)
    signs = packing.majority_signs(t, n, tie_positive)
    np.testing.assert_array_equal(signs.numpy(), _reference(counts, n, 1 if tie_positive else -1))
    bits = packing.unpack_bits(packing.pack_majority(t, n, tie_positive), counts.size)
    np.testing.assert_array_equal(bits.numpy().astype(np.int8) * 2 - 1, signs.numpy())
