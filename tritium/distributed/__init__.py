"""Distributed helpers: amax reduction (tensor/sequence/context parallel come with their issues)."""
from .amax import reduce_amax_rows

__all__ = ["reduce_amax_rows"]
