"""Triton kernels and their thin launchers. No autograd, nn or distributed code lives here;
every launcher has a pure-PyTorch twin of the same name in `tritium.ref`."""
