"""Interp tier (see conftest.py). A package, so its module names cannot clash with other tiers'."""
