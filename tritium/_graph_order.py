"""make_graphed_callables' pipeline layout (`_order`, `_num_layers_per_chunk`) and its
`capture_time_hooks` argument: validation and bookkeeping, no CUDA.

TE / Megatron semantics. With interleaved pipeline parallelism a rank holds C model chunks, each
a run of layers; the schedule runs, per microbatch, a chunk's forward (+c in `_order`, c =
1..C) and later its backward (-c). `_order` lists those passes in the order the schedule runs
them, e.g. [1, 2, 1, 2, -2, -1, -2, -1] (2 chunks, 2 microbatches: both forwards of both
microbatches, then the backwards, last chunk first). So M = len(_order) / (2 C) microbatches,
every chunk appears M times with each sign, and a chunk's k-th backward comes after its k-th
forward. `modules` are all layers, chunk after chunk; `_num_layers_per_chunk` (default: equal
chunks) says how many belong to each. Every (chunk, microbatch, layer) is one graph entry with
its own sample args, laid out chunk-major: entry = first_layer(c) * M + m * L_c + l. Captures
follow `_order`: a forward pass of chunk c captures its layers' forwards for its next
microbatch in layer order, a backward pass their backwards in reverse layer order.
"""
from __future__ import annotations

from typing import Optional

_HOOK_KINDS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")


class Layout:
    def __init__(self, order, num_layers_per_chunk: Optional[list], n_callables: int):
        if not isinstance(order, (list, tuple)) or not order or \
                not all(isinstance(c, int) and not isinstance(c, bool) and c != 0 for c in order):
            raise ValueError(f"make_graphed_callables: _order must be a non-empty list of non-zero "
                             f"ints (+c forward, -c backward of chunk c), got {order!r}")
        chunks = max(abs(c) for c in order)
        if len(order) % (2 * chunks):
            raise ValueError(f"make_graphed_callables: _order has {len(order)} entries for "
                             f"{chunks} chunks; it needs 2 x chunks x microbatches")
        mbs = len(order) // (2 * chunks)
        seen = {}
        for c in order:
            fwd, bwd = seen.get(abs(c), (0, 0))
            fwd, bwd = (fwd + 1, bwd) if c > 0 else (fwd, bwd + 1)
            if bwd > fwd:
                raise ValueError(f"make_graphed_callables: _order runs a backward of chunk "
                                 f"{abs(c)} before its forward ({order!r})")
            seen[abs(c)] = (fwd, bwd)
        for c in range(1, chunks + 1):
            if seen.get(c) != (mbs, mbs):
                raise ValueError(f"make_graphed_callables: _order must run every chunk 1..{chunks}"
                                 f" forward and backward {mbs} times each; chunk {c} runs "
                                 f"{seen.get(c, (0, 0))} (forward, backward)")
        if num_layers_per_chunk is None:
            if n_callables % chunks:
                raise ValueError(f"make_graphed_callables: {n_callables} callables do not split "
                                 f"into {chunks} equal chunks; pass _num_layers_per_chunk")
            num_layers_per_chunk = [n_callables // chunks] * chunks
        layers = list(num_layers_per_chunk)
        if len(layers) != chunks or sum(layers) != n_callables or min(layers) < 1:
            raise ValueError(f"make_graphed_callables: _num_layers_per_chunk={layers} must give "
                             f"{chunks} chunks of >= 1 layers summing to {n_callables} callables")
        self.order, self.chunks, self.mbs, self.layers = list(order), chunks, mbs, layers
        self.first = [sum(layers[:c]) for c in range(chunks)]

    def entry(self, chunk: int, mb: int, layer: int) -> int:
        return self.first[chunk] * self.mbs + mb * self.layers[chunk] + layer

    def per_entry(self, items: tuple) -> tuple:
        """Per-callable items -> one per graph entry (chunk-major, then microbatch, layer)."""
        return tuple(items[self.first[c] + l] for c in range(self.chunks)
                     for _ in range(self.mbs) for l in range(self.layers[c]))

    def capture_sequence(self, caps: list) -> list:
        """(("fwd" | "bwd"), cap) steps in _order's order."""
        steps, done = [], {"fwd": [0] * self.chunks, "bwd": [0] * self.chunks}
        for c in self.order:
            kind, chunk = ("fwd", c - 1) if c > 0 else ("bwd", -c - 1)
            mb = done[kind][chunk]
            done[kind][chunk] += 1
            layers = range(self.layers[chunk])
            for layer in (layers if kind == "fwd" else reversed(layers)):
                steps.append((kind, caps[self.entry(chunk, mb, layer)]))
        return steps


def hooks_per_callable(hooks, n: int) -> list:
    """Validate capture_time_hooks: None, or a list of n entries, each None or a dict of hook
    kinds -> {id: hook}."""
    if hooks is None:
        return [None] * n
    if not isinstance(hooks, (list, tuple)) or len(hooks) != n:
        raise ValueError(f"make_graphed_callables: capture_time_hooks must be a list with one "
                         f"entry (None or a dict) per callable ({n}), got {hooks!r}")
    for i, h in enumerate(hooks):
        if h is None:
            continue
        if not isinstance(h, dict) or set(h) - set(_HOOK_KINDS):
            raise ValueError(f"make_graphed_callables: capture_time_hooks[{i}] must be a dict "
                             f"with keys among {_HOOK_KINDS}, got {h!r}")
        for kind, table in h.items():
            if not isinstance(table, dict) or not all(callable(f) for f in table.values()):
                raise ValueError(f"make_graphed_callables: capture_time_hooks[{i}][{kind!r}] "
                                 "must be a dict {id: callable}")
    return list(hooks)


def first_per_callable(caps: list) -> list:
    """One entry per distinct callable (several graph entries may share a module)."""
    seen, out = set(), []
    for cap in caps:
        if id(cap.func) not in seen:
            seen.add(id(cap.func))
            out.append(cap)
    return out
