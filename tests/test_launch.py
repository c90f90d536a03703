"""The Launcher's direct-launch bookkeeping on the CPU, with stand-ins for Triton's compiled
objects (the launches themselves run in the gpu tier: every kernel test there goes through it).

What must hold: an entry takes the direct path only where Triton's launcher has the layout it
relies on (no scratch memory, a C entry point, descriptor metadata for every TensorDesc), and
falls back to `compiled.run` otherwise; descriptors are encoded once per (pointer, shape,
strides, layout) and expanded as the C entry point takes them.
"""
import types

import pytest
import torch

from tritium.kernels import _launch
from tritium.kernels._launch import TensorDesc


def _compiled(launch, *, scratch=0, metas=None):
    run = types.SimpleNamespace(launch=launch, global_scratch_size=scratch,
                                profile_scratch_size=0, launch_cooperative_grid=False,
                                launch_pdl=False)
    return types.SimpleNamespace(run=run, function=7, packed_metadata=(4, 1, 0),
                                 metadata=types.SimpleNamespace(tensordesc_meta=metas))


C_ENTRY = print  # any builtin: a C function has no __code__


def test_entry_direct_for_a_c_entry_point():
    entry = _launch._entry(_compiled(C_ENTRY), (1, 2), [])
    assert entry[0] is C_ENTRY and entry[3] == (1, 2) and entry[4] is None
    assert entry[5] == (False, False, None, None)


@pytest.mark.parametrize("case", ["scratch", "python_wrapper", "no_launch"])
def test_entry_falls_back_to_run(case):
    if case == "scratch":
        compiled = _compiled(C_ENTRY, scratch=128)
    elif case == "python_wrapper":
        compiled = _compiled(lambda *a: None)
    else:
        compiled = _compiled(None)
    entry = _launch._entry(compiled, (), [])
    assert entry[0] is None and entry[5] is compiled.run


def test_entry_with_descriptors_needs_the_wrapped_c_entry_and_metadata(monkeypatch):
    monkeypatch.setattr(_launch, "_tma_encoder", lambda: (lambda *a: "map", {3: 3}))
    meta = {"swizzle": 128, "elem_size": 1, "elem_type": 3, "block_size": [16, 32],
            "fp4_padded": False}

    def make_wrapper(launcher):
        def inner(*args):
            return launcher(*args)
        return inner
    entry = _launch._entry(_compiled(make_wrapper(C_ENTRY), metas=[meta]), (), [2])
    assert entry[0] is C_ENTRY
    assert entry[4][0][:2] == (2, (128, 1, 3, (16, 32)))
    # a wrapper without the C entry point, or metadata that does not match: Triton's path
    assert _launch._entry(_compiled(lambda *a: None, metas=[meta]), (), [2])[0] is None
    assert _launch._entry(_compiled(make_wrapper(C_ENTRY), metas=[]), (), [2])[0] is None
    assert _launch._entry(_compiled(make_wrapper(C_ENTRY), metas=[meta]), (), [1, 2])[0] is None


def test_descriptors_encoded_once_per_pointer_shape_and_layout(monkeypatch):
    monkeypatch.setattr(_launch, "_tensor_maps", {})
    calls = []

    def fill(ptr, swizzle, elem_size, elem_type, block, shape, strides, padding):
        calls.append((ptr, tuple(shape), tuple(strides), block))
        return object()
    layout = (128, 1, 0, (16, 32))
    buf = torch.empty(64, 64)
    a, b = buf[:32], buf[32:]
    first = _launch._expand_descriptors([5, TensorDesc(a, (16, 32)), 6], [(1, layout, fill)])
    again = _launch._expand_descriptors([5, TensorDesc(a, (16, 32)), 6], [(1, layout, fill)])
    other = _launch._expand_descriptors([5, TensorDesc(b, (16, 32)), 6], [(1, layout, fill)])
    assert len(calls) == 2 and calls[0][0] == a.data_ptr() and calls[1][0] == b.data_ptr()
    assert first[1] is again[1] and other[1] is not first[1]
    assert first[0] == 5 and first[2:] == [32, 64, 64, 1, 6]  # map, shape, strides in place


def test_key_and_flat_pass_tensors_as_pointers():
    x = torch.empty(8, 16, dtype=torch.bfloat16)
    key, flat = _launch._key_and_flat(0, (x, 17, 2.5), 4, {"BLOCK": 32})
    assert flat == [x.data_ptr(), 17, 2.5]
    assert key[:3] == (0, 4, 32) and key[3] == torch.bfloat16 and key[4] == x.data_ptr() & 15
    assert key[5] == (False, True) and key[6] is float


def test_fixed_launch_without_a_cache_calls_the_launcher_each_time():
    calls = []

    class FakeLauncher:
        _cache = None

        def __call__(self, grid, *args, **options):
            calls.append((grid, args, options))
    fixed = _launch._FixedLaunch(FakeLauncher(), (3,), (torch.zeros(2),), 4, None, {"B": 8})
    fixed()
    fixed()
    assert len(calls) == 2 and calls[0][0] == (3,) and calls[0][2]["B"] == 8
