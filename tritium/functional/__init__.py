"""Autograd Functions and the functional API; each call picks a Triton kernel or its ref twin."""
from .gemm import fp8_gemm_tn
from .fp8_plan import FP8Plan, WeightCache
from .linear import MainGradTarget, linear

__all__ = ["fp8_gemm_tn", "FP8Plan", "MainGradTarget", "WeightCache", "linear"]
