"""cpu tier: the FP8 all-gather of block-scaled operands under sequence parallelism
(functional/block_sp.py), 2 gloo processes, emulated FP8.

What is asserted, on fresh random data:
  * the gather itself: each rank quantizes its own rows and the gathered forms (rowwise data and
    scales, columnwise data and scales) are those of quantizing the gathered high-precision
    tensor, bit for bit, for 1x128 blocks (128 local tokens) and MXFP8's 1x32 (96 local
    tokens); with 80 local tokens the rowwise form still is, the columnwise form is not (its
    128-token blocks would span both ranks: why that case falls back);
  * modules (Linear column / row, LayerNormLinear, LayerNormMLP gelu / swiglu, in fp32, some
    in bf16; a TransformerLayer and LayerNormMLP(checkpoint=True); 128 local tokens): with the
    FP8 gather every output and gradient equals the high-precision gather's
    (`fp8_block_gather(False)`) bit for bit, and (fp32) the unsharded module's as
    tests/test_tensor_parallel_block.py states (bit-identical where every reduction dim is
    whole, fp32 tolerance where a split sum is finished by a collective); the norm's block cast
    runs fused under SP now (a spy counts it; not with checkpoint=True);
  * the bytes every rank puts into the gathers (counted at tensor_parallel's all-gather, as
    testlib.all_gather_sizes does for FSDP2): exactly one form (fp8 data + scales,
    1 + 4/128 bytes an element) per column GEMM in forward, <= 0.55x the high-precision gather
    (bf16 included); the columnwise form in backward; both grad forms for a row GEMM;
  * the fallback (80 local tokens, not a multiple of 128): the high-precision bytes travel, the
    norm is not fused, and the results equal the unsharded module's as before;
  * MXFP8 (emulated), Linear column / row with 96 local tokens: the same, with 32-element
    blocks and E8M0 scale bytes.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from test_tensor_parallel import _seed
from test_tensor_parallel_block import (B, F, H, _build, _check, _exact, _perturb_norm, _recipe,
                                        _Spy, _unsharded_pairs)
from testlib import all_gather_sizes, assert_bits, FP32_TOL, gloo_group, spawn_results

pytestmark = pytest.mark.cpu

S_FP8, S_MX, S_FALLBACK = 128, 96, 80   # 2 ranks, batch 2: 128 / 96 / 80 local tokens
KINDS = ("linear-col", "linear-row", "lnlinear", "lnmlp-gelu", "lnmlp-swiglu")
CASES = ([f"{k}/fp32" for k in KINDS] + ["linear-col/bf16", "linear-row/bf16", "lnmlp-gelu/bf16"]
         + ["linear-col/mx", "linear-row/mx"]
         + ["linear-col/fallback", "linear-row/fallback", "lnlinear/fallback"]
         + ["layer/fp32", "lnmlp-ckpt/fp32"])
# compared with the high-precision gather only (the unsharded comparison: the cases above and
# tests/test_tensor_parallel_block.py)
SAME_ONLY = {"linear-col/bf16", "linear-row/bf16", "lnmlp-gelu/bf16", "layer/fp32",
             "lnmlp-ckpt/fp32"}


# --------------------------------------------------------------------------- worker side
def _mx_or(form: str):
    from tritium import recipe
    return recipe.MXFP8BlockScaling() if form == "mx" else _recipe("128x128")


def _run_counted(mod, x, dy, rcp, fp8_gather: bool):
    """(y, dx, {param: grad}) of one fwd+bwd, and the bytes each all-gather of tensor
    parallelism sent from this rank, in forward and in backward."""
    import tritium as te
    from tritium.distributed import tensor_parallel as T
    from tritium.functional.block_sp import fp8_block_gather
    leaf = x.clone().requires_grad_()
    with fp8_block_gather(fp8_gather):
        with all_gather_sizes(T, "_all_gather") as fwd, te.fp8_autocast(fp8_recipe=rcp):
            y = mod(leaf)
        with all_gather_sizes(T, "_all_gather") as bwd:
            y.backward(dy)
    grads = {n: p.grad for n, p in mod.named_parameters()}
    for p in mod.parameters():
        p.grad = None
    return (y.detach(), leaf.grad, grads), fwd, bwd


def _build_sp(kind, tp: dict, device="cpu"):
    """_build's modules, a TransformerLayer (LayerNorm QKV, gelu MLP; set_parallel_mode) and a
    LayerNormMLP(checkpoint=True) (fc1 and its input gather recomputed in backward)."""
    import tritium as te
    if kind == "layer":
        return te.TransformerLayer(H, F, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                   set_parallel_mode=True, device=device, **tp), H, H
    if kind == "lnmlp-ckpt":
        return te.LayerNormMLP(H, F, set_parallel_mode=True, checkpoint=True, device=device,
                               **tp), H, H
    return _build(kind, tp, device)


def _module_case(name, group, world, rank, spy, device="cpu"):
    """The SP module (its own init on each rank) and the unsharded one loaded with the gathered
    state dict, on the same full data: FP8 gather, high-precision gather, unsharded (on the CPU
    only: elsewhere the first two)."""
    from tritium.distributed import tensor_parallel as T
    kind, how = name.split("/")
    s = {"mx": S_MX, "fallback": S_FALLBACK}.get(how, S_FP8)
    dtype = torch.bfloat16 if how == "bf16" else torch.float32
    extra = {"params_dtype": dtype} if how == "bf16" else {}
    torch.manual_seed(_seed(name) + rank)
    tp_mod, k_in, n_out = _build_sp(kind, dict(tp_group=group, sequence_parallel=True,
                                               **extra), device)
    _perturb_norm(tp_mod, _seed(name))
    col = kind in ("linear-col", "lnlinear")
    g = torch.Generator().manual_seed(_seed(name) + 1)   # the same data on every rank
    x = torch.randn(s, B, k_in, generator=g).to(device, dtype)
    dy = torch.randn(s, B, n_out, generator=g).to(device, dtype)
    x_loc = x.chunk(world, -1 if kind == "linear-row" else 0)[rank]
    out_blocks = (n_out // 2, n_out // 2) if kind == "lnlinear" else (n_out,)
    dy_loc = T.shard_tensor(dy, -1, out_blocks, world, rank) if col else dy.chunk(world)[rank]
    rcp = _mx_or(how)
    spy.take()
    got, fwd8, bwd8 = _run_counted(tp_mod, x_loc, dy_loc, rcp, True)
    calls = spy.take()
    hp, fwd_hp, bwd_hp = _run_counted(tp_mod, x_loc, dy_loc, rcp, False)
    hp_calls = spy.take()
    same = [("y", got[0], hp[0]), ("dx", got[1], hp[1])]
    same += [(f"d{n}", got[2][n], hp[2][n]) for n in got[2]]
    res = {"same": same, "bytes": {"fp8": (fwd8, bwd8), "hp": (fwd_hp, bwd_hp)},
           "calls": calls, "hp_calls": hp_calls, "tokens": s * B // world,
           "elt": x.element_size()}
    if name in SAME_ONLY or device != "cpu":
        return res
    ref, _, _ = _build(kind, extra)
    ref.load_state_dict(T.gather_full_state_dict(tp_mod))
    want, _, _ = _run_counted(ref, x, dy, rcp, True)
    res["pairs"] = _unsharded_pairs(tp_mod, got, want, group, world,
                                    -1 if kind == "linear-row" else 0, -1 if col else 0,
                                    out_blocks)
    return res


def _gather_unit_case(group, world, rank):
    """block_sp's gather of every form vs quantizing the gathered tensor: {case: [(field,
    gathered, whole)]}, input (forward dtype, input QParams) and grad (backward ones)."""
    from tritium.distributed.tensor_parallel import TPSpec
    from tritium.functional import block_sp
    from tritium.functional.block_linear import BlockScheme
    spec = TPSpec("column", group, world, True)
    out = {}
    for case, form, local in (("1x128", "128x128", 128), ("mx", "mx", 96),
                              ("1x128 cut", "128x128", 80)):
        scheme = BlockScheme.of(_mx_or(form))
        g = torch.Generator().manual_seed(_seed(case))
        full = torch.randn(local * world, 384, generator=g) * torch.rand(local * world, 1,
                                                                         generator=g) * 9
        mine = full.chunk(world)[rank]
        for role, q, dt in (("x", scheme.x_q, scheme.fwd_dtype),
                            ("dy", scheme.g_q, scheme.bwd_dtype)):
            local_q = scheme.quantize(mine, q, dt, rowwise=True, columnwise=True)
            got = block_sp._gather_forms(local_q, (0, 1, 2, 3), scheme.mx, spec)
            want = scheme.quantize(full, q, dt, rowwise=True, columnwise=True)
            out[f"{case} {role}"] = list(zip(("data", "scale_inv", "data_t", "scale_inv_t"),
                                             got, want))
    return out


def _worker(rank, port, out_dir, world):
    import torch.distributed as dist
    with gloo_group(rank, world, port):
        group, spy = dist.group.WORLD, _Spy()
        results = {name: _module_case(name, group, world, rank, spy) for name in CASES}
        results["unit"] = _gather_unit_case(group, world, rank)
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "results.pt"))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn_results(_worker, 2, tmp_path_factory.mktemp("tpblocksp"), 2)


# --------------------------------------------------------------------------- checks
def _form_bytes(elements: int, mx: bool) -> int:
    """One block-quantized form: a byte an element, and a scale a block (1x128: fp32;
    MXFP8: its E8M0 byte)."""
    return elements + (elements // 32 if mx else elements // 128 * 4)


def _expected_bytes(kind: str, how: str, tokens: int, elt: int):
    """{"fp8"/"hp": (forward, backward) bytes this rank gathers} from the layer's structure:
    column GEMMs gather their input [tokens, H] (fp8: rowwise in forward, columnwise in
    backward), row GEMMs their grad [tokens, H] in backward (fp8: both forms); a checkpointed
    fc1 gathers its input again in the backward's recompute."""
    one = _form_bytes(tokens * H, how == "mx")
    cols, rows = {"linear-col": (1, 0), "lnlinear": (1, 0), "linear-row": (0, 1),
                  "layer": (2, 2)}.get(kind, (1, 1))
    fwd8, bwd8 = cols * one, cols * one + rows * 2 * one
    fwd_hp, bwd_hp = cols * tokens * H * elt, rows * tokens * H * elt
    if kind == "lnmlp-ckpt":
        bwd8, bwd_hp = bwd8 + one, bwd_hp + fwd_hp
    return {"fp8": (fwd8, bwd8), "hp": (fwd_hp, bwd_hp)}


@pytest.mark.parametrize("name", CASES)
def test_block_sp_fp8_gather_equals_hp_gather(world2, name):
    """Outputs, input gradient and every parameter gradient: the same bits with the FP8
    gather as with the high-precision one (fallback cases: both run the latter)."""
    res = world2[name]
    assert len(res["same"]) > 2
    for label, got, want in res["same"]:
        assert got is not None and want.abs().max() > 0, (name, label)
        assert_bits(got, want, f"{name} {label}")


@pytest.mark.parametrize("name", [c for c in CASES if c not in SAME_ONLY])
def test_block_sp_matches_unsharded(world2, name):
    """As tests/test_tensor_parallel_block.py: bit-identical where every reduction dim is
    whole on each rank, fp32 tolerance (and not the same bits) where a split sum is finished
    by a collective."""
    kind, how = name.split("/")
    res = world2[name]
    if how != "mx":
        _check(f"{kind}/sp", res)
        return
    # MXFP8's emulated GEMM (fp32 products of exact dequantized values) may sum a split
    # reduction to the same bits: there only closeness is asserted
    assert len(res["pairs"]) > 2
    for label, got, want in res["pairs"]:
        if _exact(kind, "sp", label):
            assert_bits(got, want, f"{name} {label}")
        else:
            torch.testing.assert_close(got, want, **FP32_TOL, msg=lambda m: f"{name} {label}: {m}")


@pytest.mark.parametrize("name", CASES)
def test_block_sp_gather_bytes(world2, name):
    """The bytes gathered, exactly as the layer's structure says; the FP8 forward <= 0.55x
    the high-precision one; the fallback sends the high-precision bytes with the switch on."""
    kind, how = name.split("/")
    res = world2[name]
    sent = {k: tuple(sum(s) for s in v) for k, v in res["bytes"].items()}
    want = _expected_bytes(kind, how, res["tokens"], res["elt"])
    assert sent["hp"] == want["hp"], (name, sent, want)
    if how == "fallback":
        assert sent["fp8"] == want["hp"], (name, sent, want)
        return
    assert sent["fp8"] == want["fp8"], (name, sent, want)
    fwd8, fwd_hp = sent["fp8"][0], sent["hp"][0]
    if kind != "linear-row":
        assert fwd8 <= 0.55 * fwd_hp, (name, fwd8, fwd_hp)
    if how == "bf16":   # one form of 1x128 blocks: 1.03 bytes an element, bf16's 2
        assert fwd8 == 0 or math.isclose(fwd8 / fwd_hp, (1 + 4 / 128) / 2), (fwd8, fwd_hp)


@pytest.mark.parametrize("name", [c for c in CASES if c.startswith(("ln", "layer"))])
def test_block_sp_fused_norm(world2, name):
    """The norm writes the column GEMM's blocks under SP where the gather is FP8, and not
    where it is high precision (fallback, or the switch off), nor with checkpoint=True."""
    res = world2[name]
    fused = 0 if name.endswith("/fallback") or "ckpt" in name else 2 if "layer" in name else 1
    assert res["calls"]["norm"] == fused, res["calls"]
    assert res["hp_calls"]["norm"] == 0, res["hp_calls"]


def test_block_sp_gather_forms_bitwise(world2):
    """Each rank quantizes its rows, the forms are gathered: the gathered tensor's blocks bit
    for bit; with 80 local tokens (not whole 128-token blocks) only the rowwise form is."""
    unit = world2["unit"]
    assert set(unit) == {f"{c} {r}" for c in ("1x128", "mx", "1x128 cut") for r in ("x", "dy")}
    for case, fields in unit.items():
        assert [f for f, _, _ in fields] == ["data", "scale_inv", "data_t", "scale_inv_t"]
        for field, got, want in fields:
            if case.startswith("1x128 cut") and field.endswith("_t"):
                assert got.shape == want.shape
                assert not torch.equal(got.float(), want.float()), (case, field)
            else:
                assert_bits(got, want, f"{case} {field}")


def test_block_sp_refuses_mismatched_blocks():
    """Before any collective: a fused norm's carrier that reaches the high-precision gather
    (80 local tokens) is refused, and so is a carrier whose blocks are not the recipe's form;
    the block Linear refuses pre-quantized blocks of the other block form (1x128 vs MXFP8)."""
    from types import SimpleNamespace
    from tritium.distributed.tensor_parallel import TPSpec
    from tritium.functional import block_sp
    from tritium.functional.block_linear import BlockScheme, _check_block_operand
    from tritium.functional.fused_cast import block_carrier
    spec = TPSpec("column", None, 2, True)   # no group: nothing may reach a collective
    plan = SimpleNamespace(recipe=_recipe("128x128"), grad=True)
    scheme = BlockScheme.of(plan.recipe)
    weight = torch.zeros(8, H)
    for tokens in (80, 128):
        x = torch.randn(tokens, H)
        q = scheme.quantize(x, scheme.x_q, scheme.fwd_dtype, rowwise=True, columnwise=True)
        carrier = block_carrier(q._replace(data=q.data[: tokens // 2]), (tokens, H), x.dtype)
        with pytest.raises((RuntimeError, ValueError)) as err:
            block_sp.gather_input(carrier, plan, weight, (), spec)
        text = str(err.value)
        assert ("reached the high-precision gather" if tokens == 80 else
                "must hold 128 rows") in text, text
    mx = BlockScheme.of(_mx_or("mx"))
    q = scheme.quantize(torch.randn(128, H), scheme.x_q, scheme.fwd_dtype, rowwise=True,
                        columnwise=False)
    with pytest.raises(ValueError, match="must hold 1x32 MXFP8"):
        _check_block_operand(q, mx, (128, H), mx.fwd_dtype, "input")
