"""Pure-PyTorch twins of every launcher in `tritium.kernels` (same names, signatures, bits).
They are the CPU path and the test oracle, and never import triton."""
