"""tritium's kernels as PyTorch custom operators, so `torch.compile` traces every module whole.

What. Each family of device work (ops/cast.py, norm.py, activation.py, rope.py, scaling.py,
gemm.py, cross_entropy.py) registers `tritium::<name>` ops through `_common.tritium_op`
(custom_op's schema inference, registered with the dispatcher directly: see its note). An op's
real implementation calls exactly what eager calls: the Triton launcher in `tritium.kernels`
where `_device.use_triton(t)` says so (CUDA, or the CPU under TRITON_INTERPRET=1; with the same
extra conditions as the eager site, e.g. norm's MAX_HIDDEN), its twin in `tritium.ref`
otherwise. So the CPU path is behind the same ops and CPU runs exercise the tracing. Every op has
a fake (meta) implementation giving output shapes, dtypes and devices, and declares in
`mutates_args` each tensor it writes in place (amax accumulators, the scaling update's scale and
history, cross-entropy's gradient buffer, a GEMM's `out`). Outputs are contiguous and never alias
inputs (an output that would is cloned, see `_common.fresh`).

Namespaces. Each module also defines functions with THE SAME names and Python signatures as its
`tritium.ref` twin (`ops.cast.cast_transpose(x, scale, amax, fp8_dtype, *, pad_rows_to=...)`),
which turn Python arguments into op arguments (tuples such as `current=(eps, pow2)` and job
tuples into scalars, None into an op choice) and map results back (an empty placeholder into
None where a Python flag said "not written"; flags are constants at trace time). The functional
layer's `_impl(t)` returns this module instead of the kernel or ref module when
`torch.compiler.is_compiling()`: eager never goes through an op and stays as it was.

Why not `triton_op`: the launchers do host work (tile choice, cached launch
closures, kernel-or-twin choice) that is not traceable, and one op covers both implementations;
inductor treats the op as an opaque call.

Why no `register_autograd`: tritium's autograd.Functions call these ops in their forward and
backward, and dynamo traces those Functions (forward and backward) itself; the ops are never
differentiated through.

The delayed-scaling update (fp8/scaling.py) goes through the `tritium::delayed_scaling_update`
op too (not the ref function traced directly), so a compiled step runs the same Triton kernel
as eager on CUDA.

Not supported under compile: the CUDA-graph extras of cast_transpose (`skip=`, `out=`): a clear
error names them. Not covered yet: the MoE, grouped-GEMM, block-scaling, flash-attention and
optimizer kernels (their call sites still launch Triton directly; ops/grouped_gemm.py only
chooses between the grouped Triton GEMMs and cuBLASLt per group). Imports only go down: ops
imports _device, _env, ref and (lazily, on first use) kernels; fp8/ and functional/ import ops.
"""
