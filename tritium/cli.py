"""`python -m tritium demo|bench|numerics`: the first things a newcomer runs.

demo      Trains a small Llama-style byte-level LM (te.TransformerLayer blocks) twice from the
          same weights on the same batches, high precision vs FP8, and prints a table and writes
          loss curves and a checkpoint: tritium/demo.py.
bench     Runs every `benchmarks/bench_*.py` on a CUDA GPU and writes one merged JSON, a markdown
          table and charts to benchmarks/results/; without a GPU it says so and exits 0:
          tritium/bench.py. `bench --markdown` runs nothing: it regenerates the tables of
          benchmarks/RESULTS.md and README's Speed table from benchmarks/results/*.json:
          tritium/bench_report.py.
numerics  Measures every module's error against float64 PyTorch in fp32, bf16, fp16 and FP8 and
          writes docs/numerics.md: tritium/numerics.py.

This file only parses arguments; each command's code is imported when it runs.
"""
from __future__ import annotations

import argparse


def demo(args) -> int:
    from .demo import main as run
    return run(args)


def bench(args) -> int:
    if args.markdown:
        from .bench import repo_root
        from .bench_report import write_markdown
        changed = write_markdown(repo_root())
        print("tritium bench --markdown: " + (", ".join(str(p) for p in changed) + " updated"
                                              if changed else "tables already up to date"))
        return 0
    from .bench import run
    return run(args.only, args.out)


def numerics(args) -> int:
    from .numerics import main as run  # imported on demand: the demo does not need it
    return run(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tritium", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="train a small Llama-style LM in high precision and in FP8")
    from .demo import add_arguments
    add_arguments(p)
    p.set_defaults(func=demo)
    p = sub.add_parser("bench", help="run benchmarks/bench_*.py (needs a CUDA GPU)")
    p.add_argument("only", nargs="*", help="run only benchmarks whose name contains one of these")
    p.add_argument("--out", default=None, help="report folder (default benchmarks/results)")
    p.add_argument("--markdown", action="store_true",
                   help="run nothing; regenerate benchmarks/RESULTS.md's tables and README's "
                        "Speed table from benchmarks/results/*.json (no GPU needed)")
    p.set_defaults(func=bench)
    p = sub.add_parser("numerics", help="measure every module's error vs float64 PyTorch")
    p.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda if present)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per module (default 3)")
    p.add_argument("--out", default="docs/numerics.md", help="markdown file to write")
    p.add_argument("--quick", action="store_true", help="tiny shapes (tests)")
    p.set_defaults(func=numerics)
    args = parser.parse_args(argv)
    return args.func(args)
