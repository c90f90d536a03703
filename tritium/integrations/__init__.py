"""Weight mappings between tritium modules and other model code (Llama-style MLPs for now)."""
