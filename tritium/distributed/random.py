"""CudaRNGStatesTracker: named RNG states for dropout under tensor parallelism (TE / Megatron).

Replicated activations must see the same dropout mask on every TP rank (the default generator,
seeded alike everywhere); sharded ones (this rank's heads, this rank's sequence rows) must see
different masks. The tracker keeps named generator states, each seeded per rank by the caller
(`add("model-parallel-rng", base_seed + tp_rank)`); `fork(name)` swaps the default generator's
state for the named one inside the block and keeps what the block drew, so the default stream
continues as if the block had not run. The generator is CUDA's when CUDA is available (as TE's),
else the CPU one, so the same code runs (and is tested) on CPU.
"""
from __future__ import annotations

import contextlib

import torch

_MODEL_PARALLEL_RNG = "model-parallel-rng"


def _use_cuda() -> bool:
    return torch.cuda.is_available()


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _use_cuda() else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if _use_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _seed(seed: int) -> None:
    if _use_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named RNG states: add(name, seed), fork(name), get_states/set_states, reset."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict:
        """A copy of the named states (for checkpointing and activation recomputation)."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict) -> None:
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """A new named state seeded with `seed` (each name and each seed once)."""
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} is already used by another "
                             "state; give each state its own seed")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: a state named {name!r} already exists "
                             "(reset() to start over)")
        self.seeds_.add(seed)
        before = _get_state()
        try:
            _seed(seed)
            self.states_[name] = _get_state()
        finally:
            _set_state(before)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG):
        """Draw from the named state inside the block; the default state is restored after."""
        if name not in self.states_:
            raise KeyError(f"CudaRNGStatesTracker.fork: no state named {name!r}; add it first "
                           f"with tracker.add({name!r}, seed)")
        before = _get_state()
        _set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_state()
            _set_state(before)


__all__ = ["CudaRNGStatesTracker"]
