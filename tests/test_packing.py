"""Bit packing against numpy.packbits, lane round trips and the exhaustive lane-overflow oracle."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lioncub.ops import packing
from profiles import examples

LENGTHS = [0, 1, 7, 8, 9, 15, 16, 17, 23, 24, 25, 63, 64, 65, 1000, 4097]
floats32 = st.floats(allow_nan=False, width=32, allow_subnormal=True)


def signs_reference(x: np.ndarray, pad_to: int = 8) -> np.ndarray:
    bits = x >= 0
    pad = (-len(bits)) % pad_to
    return np.packbits(np.concatenate([bits, np.ones(pad, dtype=bool)]), bitorder="big")


@pytest.mark.parametrize("n", LENGTHS)
def test_pack_bits_equals_numpy(n: int) -> None:
    rng = np.random.default_rng(n)
    bits = rng.integers(0, 2, n).astype(bool)
    got = packing.pack_bits(torch.from_numpy(bits))
    assert got.dtype == torch.uint8
    np.testing.assert_array_equal(got.numpy(), np.packbits(bits, bitorder="big"))
    np.testing.assert_array_equal(packing.unpack_bits(got, n).numpy(), bits)
    # integer 0/1 input packs the same
    np.testing.assert_array_equal(
        packing.pack_bits(torch.from_numpy(bits.astype(np.uint8))).numpy(), np.packbits(bits, bitorder="big")
    )


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_pack_signs_round_trip(n: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).to(dtype)
    x[::3] = 0  # exact zeros vote "+"
    packed = packing.pack_signs(x)
    np.testing.assert_array_equal(packed.numpy(), signs_reference(x.float().numpy()))
    expected = torch.where(x >= 0, 1, -1).to(dtype)
    got = packing.unpack_signs(packed, n, dtype)
    assert got.dtype == dtype and torch.equal(got, expected)
    assert torch.equal(packing.unpack_signs(packed, n, torch.int8), expected.to(torch.int8))


@pytest.mark.parametrize("n_workers", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n", [0, 1, 9, 100, 1001])
def test_pack_signs_pads_to_multiple_of_8n(n_workers: int, n: int) -> None:
    x = torch.randn(n)
    packed = packing.pack_signs(x, pad_to=8 * n_workers)
    assert packed.numel() * 8 % (8 * n_workers) == 0
    assert packed.numel() * 8 >= n
    np.testing.assert_array_equal(packed.numpy(), signs_reference(x.numpy(), 8 * n_workers))


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(floats32, max_size=300))
def test_pack_signs_property(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    packed = packing.pack_signs(x)
    np.testing.assert_array_equal(packed.numpy(), signs_reference(np.asarray(values, dtype=np.float32)))
    assert torch.equal(packing.unpack_signs(packed, len(values)), torch.where(x >= 0, 1.0, -1.0))


@settings(max_examples=examples(200), deadline=None)
@given(st.sampled_from(packing.LANE_BITS), st.integers(0, 200), st.randoms(use_true_random=False))
def test_lane_round_trip_property(bits: int, n: int, rnd) -> None:
    values = torch.tensor([rnd.randrange(1 << bits) for _ in range(n)], dtype=torch.uint8)
    packed = packing.pack_lanes(values, bits)
    assert packed.numel() == packing.packed_size(n, bits)
    assert torch.equal(packing.unpack_lanes(packed, bits, n), values)


def test_lane_order_is_msb_first() -> None:
    assert packing.pack_lanes(torch.tensor([0xA, 0x5], dtype=torch.uint8), 4).tolist() == [0xA5]
    assert packing.pack_lanes(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [0b01101100]
    assert packing.pack_lanes(torch.tensor([3], dtype=torch.uint8), 2).tolist() == [0b11000000]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_lane_sums_decode_to_elementwise_sums(bits: int) -> None:
    """Summing packed bytes equals packing the lane-wise sums whenever the sum fits the lane."""
    n_workers = packing.max_lane_workers(bits, 1)
    rng = np.random.default_rng(bits)
    votes = torch.from_numpy(rng.integers(0, 2, (n_workers, 101)).astype(np.uint8))
    byte_sum = sum(packing.pack_lanes(v, bits).to(torch.int64) for v in votes)
    assert int(byte_sum.max()) <= 255
    lane_sum = packing.unpack_lanes(byte_sum.to(torch.uint8), bits, 101)
    assert torch.equal(lane_sum.to(torch.int64), votes.to(torch.int64).sum(0))


@pytest.mark.parametrize("s", [0, 1, 7, 63, 127])
def test_offset_encoding_round_trip(s: int) -> None:
    levels = torch.arange(-s, s + 1, dtype=torch.int8)
    lanes = packing.offset_encode(levels, s)
    assert lanes.dtype == torch.uint8 and int(lanes.min()) == 0 and int(lanes.max()) == 2 * s
    for n_workers in (1, 2, 3):
        total = lanes.to(torch.int64) * n_workers
        assert torch.equal(packing.offset_decode(total, n_workers, s), levels.to(torch.int16) * n_workers)


def _summed_lanes_survive(n_workers: int, bits: int) -> list[bool]:
    """For every lane value v in ``[0, 2^bits − 1]``: really sum N packed buffers of two bytes of lanes
    all v, as a uint8 allreduce would (mod 256), and check every lane decodes to N·v. The values' buffers
    side by side, packed and summed at once (each value's lanes fill two bytes of their own)."""
    per_byte = 8 // bits
    values = torch.arange(1 << bits, dtype=torch.int64)
    lanes = values.repeat_interleave(2 * per_byte).to(torch.uint8)
    packed = packing.pack_lanes(lanes, bits).to(torch.int64)
    wire = (packed * n_workers) % 256  # byte-wise SUM in uint8 arithmetic
    decoded = packing.unpack_lanes(wire.to(torch.uint8), bits, lanes.numel()).to(torch.int64)
    return (decoded.view(-1, 2 * per_byte) == n_workers * values[:, None]).all(dim=1).tolist()


def test_lane_overflow_helper_is_exact() -> None:
    """Exhaustive for small N and p: 'fits' exactly when a real packed byte sum decodes correctly."""
    for bits, n_workers in itertools.product(packing.LANE_BITS, range(1, 20)):
        capacity = (1 << bits) - 1
        survive = _summed_lanes_survive(n_workers, bits)
        for value in range(0, capacity + 1):
            really_fits = survive[value]
            assert packing.lane_sum_fits(n_workers, bits, value) == really_fits, (bits, n_workers, value)
            if value == 0:
                continue
            assert (n_workers <= packing.max_lane_workers(bits, value)) == really_fits
            if really_fits:
                packing.require_lane_sum_fits(n_workers, bits, value)
            else:
                with pytest.raises(ValueError, match=f"at most {capacity // value} workers"):
                    packing.require_lane_sum_fits(n_workers, bits, value)


def test_overflow_really_corrupts_neighbours() -> None:
    """The failure the rule prevents: summing packed 1-bit votes of two workers carries into a neighbour."""
    a = packing.pack_bits(torch.tensor([0, 1, 1, 1, 1, 1, 1, 1]))
    b = packing.pack_bits(torch.tensor([0, 0, 0, 0, 0, 0, 0, 1]))
    summed = (a.to(torch.int64) + b.to(torch.int64)).to(torch.uint8)
    assert packing.unpack_bits(summed, 8).tolist() != [False] * 7 + [True]
    assert not packing.lane_sum_fits(2, 1, 1)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="bits=3"):
        packing.pack_lanes(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="pad_to"):
        packing.pack_signs(torch.zeros(4), pad_to=12)
    with pytest.raises(ValueError, match="n=9"):
        packing.unpack_bits(torch.zeros(1, dtype=torch.uint8), 9)
    with pytest.raises(TypeError, match="uint8"):
        packing.unpack_signs(torch.zeros(1, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="n_workers"):
        packing.lane_sum_fits(0, 4, 1)
    with pytest.raises(ValueError, match="max_level"):
        packing.offset_encode(torch.zeros(1, dtype=torch.int8), 200)
    with pytest.raises(ValueError, match="n=-1"):
        packing.packed_size(-1)


@pytest.fixture(params=["numpy", "torch"])
def kernel_path(request, monkeypatch) -> str:
    """Run a test on the CPU numpy kernels and on the device-generic torch kernels (what CUDA runs)."""
    if request.param == "torch":
        monkeypatch.setattr(packing, "_numpy_path", lambda t: False)
    return request.param


@pytest.mark.parametrize("n_workers", [1, 2, 3, 8, 255, 256, 300])
def test_count_votes_and_majority_against_numpy(n_workers: int, kernel_path: str) -> None:
    rng = np.random.default_rng(n_workers)
    n_bits = int(rng.integers(1, 200))
    bits = rng.random((n_workers, n_bits)) < rng.random((1, n_bits))  # per-position bias: ties happen
    rows = torch.from_numpy(np.stack([np.packbits(b, bitorder="big") for b in bits]))
    counts = packing.count_votes(rows, n_bits)
    assert counts.dtype == (torch.int16 if n_workers > 255 else torch.uint8)
    assert np.array_equal(counts.numpy(), bits.sum(axis=0))
    for tie_positive in (True, False):
        want = (2 * bits.sum(axis=0) > n_workers) | ((2 * bits.sum(axis=0) == n_workers) & tie_positive)
        got = packing.pack_majority(counts, n_workers, tie_positive)
        assert np.array_equal(got.numpy(), np.packbits(want, bitorder="big"))


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 4097])
def test_pack_signs_both_paths_equal_numpy(n: int, kernel_path: str) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[::5] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        assert np.array_equal(packing.pack_signs(x.to(dtype)).numpy(), signs_reference(x.numpy()))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_map_lanes_equals_unpack_then_lookup(bits: int) -> None:
    rng = np.random.default_rng(bits)
    values = tuple(int(v) for v in rng.integers(-128, 128, 1 << bits))
    for n in (0, 1, 3, 8, 9, 1001):
        lanes = torch.from_numpy(rng.integers(0, 1 << bits, n).astype(np.uint8))
        packed = packing.pack_lanes(lanes, bits)
        got = packing.map_lanes(packed, bits, n, values)
        assert got.dtype == torch.int8
        assert got.tolist() == [values[v] for v in lanes.tolist()]
    with pytest.raises(ValueError, match="values must have"):
        packing.map_lanes(packed, bits, 1, values[:-1])
    with pytest.raises(ValueError, match="do not fit"):
        packing.map_lanes(packed, bits, packed.numel() * (8 // bits) + 1, values)


def test_out_buffers_and_portable_gather() -> None:
    x = torch.randn(20)
    out = torch.empty(3, dtype=torch.uint8)
    assert packing.pack_signs(x, out=out).data_ptr() == out.data_ptr()
    assert np.array_equal(out.numpy(), signs_reference(x.numpy()))
    with pytest.raises(ValueError, match=r"out must be a contiguous torch\.uint8 tensor of 3 elements"):
        packing.pack_signs(x, out=torch.empty(4, dtype=torch.uint8))
    strided = torch.from_numpy(np.array([1, 0] * 16, dtype=np.uint8))[::2]  # non-contiguous: portable path
    assert packing._gather_bytes(strided).tolist() == [255, 255]
    with pytest.raises(ValueError, match="n_bits=17"):
        packing.count_votes(torch.zeros(2, 2, dtype=torch.uint8), 17)
