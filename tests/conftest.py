"""Shared fixtures for the test tiers: a fresh seed per test, TF32 off, fresh random data.

Every test gets its own seed (derived from its node id, so a test sees the same data on every
run and different tests see different data) and `randn`, which draws from a generator seeded the
same way. Tests of the `cpu` tier run the pure-PyTorch twins in `tritium.ref` (TRITIUM_FORCE_REF=1)
whatever TRITON_INTERPRET says, so they check the CPU path and nothing else.
Helpers that tests import (tolerances, the independent FP8 emulation) live in `testlib.py`.
"""
from __future__ import annotations

import zlib

import pytest
import torch


def _seed_of(nodeid: str) -> int:
    return zlib.crc32(nodeid.encode()) & 0x7FFFFFFF


def pytest_configure(config):
    """Parity is checked in true fp32: no TF32 anywhere, set once before any test runs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


@pytest.fixture(autouse=True)
def _seed(request):
    """A fresh, reproducible seed per test (torch's global RNG: module init, randn)."""
    seed = _seed_of(request.node.nodeid)
    torch.manual_seed(seed)
    return seed


@pytest.fixture(autouse=True)
def _cpu_tier_uses_ref(request, monkeypatch):
    from tritium import _env
    if request.node.get_closest_marker("cpu") is not None:
        monkeypatch.setenv("TRITIUM_FORCE_REF", "1")
    _env.reload()
    yield
    monkeypatch.undo()
    _env.reload()


@pytest.fixture
def setenv(monkeypatch):
    """setenv(name, value): set a tritium environment variable for this test only."""
    from tritium import _env

    def set_(name: str, value: str) -> None:
        monkeypatch.setenv(name, value)
        _env.reload()
    return set_


@pytest.fixture
def randn(_seed):
    """randn(*shape, scale=1.0, dtype=fp32, requires_grad=False): fresh N(0, scale^2) data from a
    generator seeded for this test (never all zeros)."""
    gen = torch.Generator().manual_seed(_seed + 1)

    def draw(*shape, scale: float = 1.0, dtype=torch.float32, requires_grad: bool = False):
        t = (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).to(dtype)
        return t.requires_grad_(requires_grad)

    return draw

