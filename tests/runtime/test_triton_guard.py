"""tests/fixtures/triton_guard.py, the interpreter's out-of-bounds check, on tiny kernels of its own:
one element past (or before) a tensor is caught in a load, a store, an atomic add, a
compare-and-swap and a tensor descriptor's load, before the access, with the kernel, the program,
the operation and the miss in bytes named; a masked-off address outside is not; an in-bounds
kernel, and one reading a view's storage beyond the view, run and give the right values. Also: the
session runs with the guard (tests/fixtures/pytest_plugin.py), and a Triton without one of the
wrapped methods is refused in words.

Interpreter only (the guard wraps it): skipped where the kernels run compiled on a GPU.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

from tests.fixtures.triton_mode import ON_GPU  # noqa: E402 (no GPU: the interpreter)

triton = pytest.importorskip("triton", reason="the guard wraps Triton's interpreter")
import triton.language as tl  # noqa: E402

from tests.fixtures import triton_guard  # noqa: E402

pytestmark = [
    pytest.mark.skipif(ON_GPU, reason="the guard checks the interpreter; on a GPU kernels run compiled"),
    pytest.mark.skipif(os.environ.get("SPECCONV_TRITON_GUARD") == "0", reason="SPECCONV_TRITON_GUARD=0"),
]


@triton.jit
def _copy(src, dst, n, shift, BLOCK: tl.constexpr):
    """dst[i] = src[i + shift] for i < n (BLOCK >= n lanes, the rest masked off)."""
    offs = tl.arange(0, BLOCK)
    keep = offs < n
    tl.store(dst + offs, tl.load(src + offs + shift, mask=keep), mask=keep)


@triton.jit
def _copy_to(src, dst, n, shift, BLOCK: tl.constexpr):
    """dst[i + shift] = src[i] for i < n."""
    offs = tl.arange(0, BLOCK)
    keep = offs < n
    tl.store(dst + offs + shift, tl.load(src + offs, mask=keep), mask=keep)


@triton.jit
def _rows(src, dst, BLOCK: tl.constexpr):
    """Program p copies row p of BLOCK values."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs))


@triton.jit
def _count(counter, index):
    tl.atomic_add(counter + index, 1)


@triton.jit
def _swap(cell, index):
    tl.atomic_cas(cell + index, 0, 1)


@triton.jit
def _through_descriptor(src, dst, n_claimed, start, BLOCK: tl.constexpr):
    """dst = src[start:start + BLOCK] through a tensor descriptor claiming src has n_claimed values."""
    desc = tl.make_tensor_descriptor(src, shape=[n_claimed], strides=[1], block_shape=[BLOCK])
    tl.store(dst + tl.arange(0, BLOCK), desc.load([start]))


def test_the_session_runs_with_the_guard():
    assert triton_guard._installed


def test_an_in_bounds_kernel_runs_and_masked_off_lanes_may_point_anywhere():
    src = torch.arange(5, dtype=torch.float32)
    dst = torch.zeros(5)
    # 64 lanes: 59 masked-off addresses lie far past both tensors
    _copy[(1,)](src, dst, 5, 0, BLOCK=64)
    assert torch.equal(dst, src)


def test_a_view_may_read_its_storage_beyond_the_view():
    """Storage bounds, not view bounds: the bytes around a view are memory the kernel may touch."""
    whole = torch.arange(8, dtype=torch.float32)
    dst = torch.zeros(3)
    _copy[(1,)](whole[2:5], dst, 3, 3, BLOCK=4)  # whole[5:8], outside the view, inside its storage
    assert torch.equal(dst, whole[5:8])


def test_a_load_one_element_past_is_caught():
    src, dst = torch.arange(5, dtype=torch.float32), torch.zeros(5)
    with pytest.raises(triton_guard.OutOfBounds, match=r"_copy: load \(program \(0, 0, 0\)\) of 4 bytes at "
                                                       r"0x[0-9a-f]+ misses by 4 bytes: past the end of the "
                                                       r"storage of 'src'"):
        _copy[(1,)](src, dst, 5, 1, BLOCK=8)
    assert torch.equal(dst, torch.zeros(5))  # caught before the store that would follow


def test_a_load_one_element_before_is_caught():
    src, dst = torch.arange(5, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.bfloat16)
    with pytest.raises(triton_guard.OutOfBounds,
                       match="of 2 bytes .* misses by 2 bytes: before the start of the storage of 'src'"):
        _copy[(1,)](src, dst, 5, -1, BLOCK=8)


def test_a_store_one_element_past_is_caught_before_it_writes():
    whole = torch.zeros(8)
    src, dst = torch.ones(4), whole[:4]
    # dst's storage is all of `whole`: writing dst[4] is legal, dst[8] is not
    _copy_to[(1,)](src, dst, 4, 4, BLOCK=4)
    assert torch.equal(whole, torch.tensor([0.0] * 4 + [1.0] * 4))
    guard_cell = torch.zeros(4)
    with pytest.raises(triton_guard.OutOfBounds,
                       match="_copy_to: store .* misses by 4 bytes: past the end of the storage of 'dst'"):
        _copy_to[(1,)](src, guard_cell, 4, 1, BLOCK=4)
    assert torch.equal(guard_cell, torch.zeros(4))  # nothing written, in bounds or not


def test_an_atomic_add_past_is_caught():
    counter = torch.zeros(3, dtype=torch.int32)
    _count[(2,)](counter, 2)
    assert counter.tolist() == [0, 0, 2]
    with pytest.raises(triton_guard.OutOfBounds, match=r"_count: atomic .* \(program \(0, 0, 0\)\) of 4 bytes "
                                                       r".* misses by 4 bytes: past the end of the storage "
                                                       r"of 'counter'"):
        _count[(2,)](counter, 3)
    assert counter.tolist() == [0, 0, 2]


def test_a_compare_and_swap_past_is_caught():
    cells = torch.zeros(2, dtype=torch.int64)
    _swap[(1,)](cells, 1)
    assert cells.tolist() == [0, 1]
    with pytest.raises(triton_guard.OutOfBounds, match="_swap: atomic cas .* of 8 bytes .* misses by 8 bytes"):
        _swap[(1,)](cells, 2)


def test_a_tensor_descriptor_past_its_tensor_is_caught():
    src, dst = torch.arange(32, dtype=torch.float32), torch.zeros(16)
    _through_descriptor[(1,)](src, dst, 32, 24, BLOCK=16)  # values 32.. lie outside the shape: zeros
    assert torch.equal(dst, torch.cat([src[24:], torch.zeros(8)]))
    with pytest.raises(triton_guard.OutOfBounds, match="_through_descriptor: load .* misses by 4 bytes: past "
                                                       "the end of the storage of 'src'"):
        _through_descriptor[(1,)](src, dst, 40, 24, BLOCK=16)  # a shape larger than the tensor


def test_the_bad_program_is_named():
    src, dst = torch.arange(8, dtype=torch.float32), torch.zeros(12)
    with pytest.raises(triton_guard.OutOfBounds, match=r"_rows: load \(program \(2, 0, 0\)\) .* misses by 4 bytes"):
        _rows[(3,)](src, dst, BLOCK=4)
    assert torch.equal(dst[:8], src)  # programs 0 and 1 ran


def test_a_triton_without_a_wrapped_method_is_refused():
    from triton.runtime import interpreter

    stand_in = types.SimpleNamespace(GridExecutor=interpreter.GridExecutor,
                                     InterpreterBuilder=type("InterpreterBuilder", (), {}))
    with pytest.raises(triton_guard.GuardUnavailable, match="no InterpreterBuilder.create_masked_load"):
        triton_guard._signature_check(stand_in)

    class Renamed(interpreter.InterpreterBuilder):
        def create_masked_store(self, pointers, value, mask, cache_policy):
            raise AssertionError("never called")

    stand_in.InterpreterBuilder = Renamed
    with pytest.raises(triton_guard.GuardUnavailable, match="create_masked_store takes"):
        triton_guard._signature_check(stand_in)
