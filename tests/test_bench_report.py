"""cpu tier: `python -m tritium bench --markdown` (tritium/bench_report.py).

The committed tables must be what the committed JSON gives: regenerating benchmarks/RESULTS.md
and README's Speed table from benchmarks/results/*.json reproduces both files byte for byte (so
running the command on a clean checkout leaves `git status` clean). On made-up runs: the latest
run per GPU kind wins, every file shape the project writes is read (one bench, the merged report
of `python -m tritium bench`, the demo's results.json), a bench with no block gets one appended,
text outside the markers is kept, targets read met / not met from the row they name, and a bench
with no spec is still rendered from its rows.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tritium import bench_report as br
from tritium.bench import merge
from tritium.cli import main

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parent.parent


def test_committed_tables_are_regenerated_byte_for_byte():
    results_md = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    readme = (ROOT / "README.md").read_text()
    new_results, new_readme = br.render(ROOT / "benchmarks" / "results", results_md, readme)
    assert new_results == results_md, "run `python -m tritium bench --markdown` and commit"
    assert new_readme == readme, "run `python -m tritium bench --markdown` and commit"
    for name in br.SUMMARY_ORDER:  # every benchmark README's table promises has a run
        assert f"<!-- bench:{name} -->" in results_md
    assert "<!-- bench:summary -->" in readme


def test_every_committed_result_file_is_cited():
    """results/ keeps the JSON the tables cite and nothing else."""
    results_md = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        assert f"results/{path.name}" in results_md, path.name
    for run in br.load_runs(ROOT / "benchmarks" / "results"):
        assert run["env"].get("commit") and run["env"].get("date"), run["file"]


def _write(folder: Path, name: str, data) -> None:
    (folder / name).write_text(json.dumps(data))


def _bench(bench, date, gpu, rows, baseline="bf16", **env):
    return {"bench": bench, "baseline": baseline,
            "env": {"date": date, "gpu": gpu, "commit": "abc1234", **env}, "rows": rows}


def _rows(ms_fp8: float, case: str = "T8192 4096->4096"):
    return [{"case": case, "variant": "bf16", "ms": 1.2, "speedup_vs_bf16": 1.0},
            {"case": case, "variant": "tritium fp8", "ms": ms_fp8,
             "speedup_vs_bf16": round(1.2 / ms_fp8, 3)},
            {"case": case, "variant": "torchao compiled", "ms": 1.1, "speedup_vs_bf16": 1.091}]


def test_latest_run_per_gpu_kind(tmp_path):
    _write(tmp_path, "a.json", _bench("newbench", "2026-11-20", "NVIDIA H100", _rows(1.0)))
    _write(tmp_path, "b.json", _bench("newbench", "2026-11-23", "NVIDIA H100", _rows(0.8)))
    _write(tmp_path, "c.json", _bench("newbench", "2026-11-21", "NVIDIA H200", _rows(0.9)))
    _write(tmp_path, "d.json", _bench("newbench", "2026-11-22", "NVIDIA H200", _rows(0.7),
                                      gpus=2))
    _write(tmp_path, "ab.json", [{"case": "x", "variant": "y"}])  # other shapes are skipped
    runs = br.latest(br.load_runs(tmp_path))["newbench"]
    assert [(r["kind"], r["file"]) for r in runs] == [
        ("2 x NVIDIA H200", "d.json"), ("NVIDIA H100", "b.json"), ("NVIDIA H200", "c.json")]
    table = br.bench_table("newbench", runs)
    # a bench with no spec: tritium columns are the "tritium..." variants, the rest are peers
    assert "| case | bf16 (baseline) | **tritium fp8** | torchao compiled |" in table
    assert "| T8192 4096->4096 | 1.200 ms (1.00x) | 0.800 ms (1.50x) | 1.100 ms (1.09x) |" in table
    assert "**NVIDIA H100**, 2026-11-23, commit `abc1234`" in table
    assert "(`results/b.json`)" in table and "(`results/a.json`)" not in table


def test_blocks_are_filled_appended_and_text_outside_kept(tmp_path):
    _write(tmp_path, "lin.json", _bench("linear", "2026-11-23", "NVIDIA H200", _rows(0.8)
                                        + _rows(3.0, "T8192 4096->14336"),
                                        baseline="bf16"))
    _write(tmp_path, "new.json", _bench("zeta", "2026-11-23", "NVIDIA H200", _rows(0.9)))
    text = ("# Results\n\nintro, kept\n\n<!-- bench:linear -->\nold table\n<!-- /bench:linear -->"
            "\n\nnote on linear, kept\n\n<!-- bench:gone -->\nold\n<!-- /bench:gone -->\n")
    readme = "# x\n\n<!-- bench:summary -->\n<!-- /bench:summary -->\n\nafter\n"
    out, new_readme = br.render(tmp_path, text, readme)
    assert out.startswith("# Results\n\nintro, kept\n\n<!-- bench:linear -->\n## Linear")
    assert "old table" not in out and "\n<!-- /bench:linear -->\n\nnote on linear, kept\n" in out
    assert "<!-- bench:gone -->\nNo run of `gone` in benchmarks/results/.\n" in out
    assert out.rstrip().endswith("<!-- /bench:zeta -->") and "## zeta" in out
    # targets: 4096 at 1.50x >= 1.2x met; 14336 at 0.40x < 1.45x not met (tritium variant named
    # in the spec is absent here, so the target reads n/a)
    assert out.count("n/a") == 2
    assert br.render(tmp_path, out, new_readme) == (out, new_readme)  # idempotent
    assert new_readme.startswith("# x\n\n<!-- bench:summary -->\n| benchmark |")
    assert new_readme.endswith("<!-- /bench:summary -->\n\nafter\n")


def test_targets_met_and_not_met(tmp_path):
    fp8 = br.LINEAR_FP8
    rows = [{"case": c, "variant": v, "ms": ms, "speedup_vs_bf16 nn.Linear": round(base / ms, 3)}
            for c, base, fp8_ms in (("T8192 4096->4096", 1.2, 0.9), ("T8192 4096->14336", 4.2, 3.0))
            for v, ms in (("bf16 nn.Linear", base), (fp8, fp8_ms))]
    _write(tmp_path, "l.json", _bench("linear", "2026-11-23", "NVIDIA H100", rows,
                                      baseline="bf16 nn.Linear"))
    by_bench = br.latest(br.load_runs(tmp_path))
    table = br.bench_table("linear", by_bench["linear"])
    assert "| 0.900 ms (1.33x) | >= 1.2x: **met** |" in table
    assert "| 3.000 ms (1.40x) | >= 1.45x: **not met** |" in table
    summary = br.summary_table(by_bench)
    assert "| Linear FP8, T8192 4096 -> 14336 | H100 | 2026-11-23, `abc1234` | **3.000 ms (1.40x)** |" \
        in summary and ">= 1.45x: not met |" in summary


def test_merged_report_and_demo_results_are_read(tmp_path):
    env = {"date": "2026-11-24", "gpu": "NVIDIA H200", "commit": "def5678", "gpus": 1}
    merged = merge([{"bench": "mlp", "baseline": "bf16", "env": env, "rows": _rows(0.6)},
                    {"bench": "cp", "baseline": "bf16", "env": {**env, "gpus": 2},
                     "rows": _rows(0.5)}])
    _write(tmp_path, "m.json", merged)
    demo = {"env": {"date": "2026-11-24", "commit": "def5678"}, "device": "NVIDIA H200",
            "params": 8.3e8, "config": {"layers": 12, "hidden": 2560, "steps": 400,
                                        "seq_len": 2048, "batch": 8},
            "runs": [{"name": "bf16", "tokens_per_s": 100.0, "held_out_loss": 1.10},
                     {"name": "fp8 delayed", "tokens_per_s": 135.0, "held_out_loss": 1.09}]}
    _write(tmp_path, "demo.json", demo)
    by_bench = br.latest(br.load_runs(tmp_path))
    assert [r["kind"] for r in by_bench["cp"]] == ["2 x NVIDIA H200"]
    assert by_bench["mlp"][0]["baseline"] == "bf16"
    table = br.bench_table("demo", by_bench["demo"])
    assert "| 100 tok/s (1.00x), held-out loss 1.1000 | 135 tok/s (1.35x), held-out loss 1.0900" \
        in table
    assert "tokens/s >= 1.3x: **met**; loss <= 1.02x: **met**" in table
    # a demo run of another recipe is a table of its own, not the delayed one's latest run
    block = {**demo, "env": {**demo["env"], "date": "2026-11-25"},
             "config": {**demo["config"], "recipe": "block"},
             "runs": [demo["runs"][0], {"name": "fp8 block", "tokens_per_s": 103.0,
                                        "held_out_loss": 1.12}]}
    _write(tmp_path, "demo-block.json", block)
    by_bench = br.latest(br.load_runs(tmp_path))
    assert by_bench["demo"][0]["file"] == "demo.json"
    table = br.bench_table("demo_block", by_bench["demo_block"])
    assert "103 tok/s (1.03x), held-out loss 1.1200 | loss <= 1.01x: **not met**" in table
    current = {**block, "config": {**demo["config"], "recipe": "current"},
               "runs": [demo["runs"][0], {"name": "fp8 current", "tokens_per_s": 120.0,
                                          "held_out_loss": 1.095}]}
    _write(tmp_path, "demo-current.json", current)
    table = br.bench_table("demo_current", br.latest(br.load_runs(tmp_path))["demo_current"])
    assert "**fp8 current**" in table and "| 120 tok/s (1.20x), held-out loss 1.0950 |" in table


def test_cli_markdown_needs_no_gpu(tmp_path, monkeypatch, capsys):
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    _write(tmp_path / "benchmarks" / "results", "r.json",
           _bench("rope", "2026-11-23", "NVIDIA H200", _rows(0.5)))
    (tmp_path / "README.md").write_text("no markers\n")
    monkeypatch.setattr("tritium.bench.repo_root", lambda: tmp_path)
    assert main(["bench", "--markdown"]) == 0
    assert "RESULTS.md" in capsys.readouterr().out
    assert "<!-- bench:rope -->" in (tmp_path / "benchmarks" / "RESULTS.md").read_text()
    assert (tmp_path / "README.md").read_text() == "no markers\n"
    assert main(["bench", "--markdown"]) == 0
    assert "already up to date" in capsys.readouterr().out


def test_compile_targets_read_the_ratio_to_another_variant(tmp_path):
    """Issue 20's targets compare two variants of one run: the bench writes the ratio into the
    compiled row (harness.add_ratio: vs_eager, vs_torchao_compiled) and the spec reads it."""
    spec = importlib.util.spec_from_file_location("harness", ROOT / "benchmarks" / "harness.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    case, base = "B2 S4096 H4096 ffn14336", "bf16 eager Llama block"
    eager, torchao = "tritium TransformerLayer fp8 delayed", "torchao fp8 tensorwise compiled"
    rows = [{"case": case, "variant": v, "ms": ms, "ktok_per_s": round(8192 / ms, 1),
             f"speedup_vs_{base}": round(21.5 / ms, 3)}
            for v, ms in ((base, 21.5), (torchao, 12.93), (eager, 12.72),
                          (br.BLOCK_COMPILED, 11.4))]
    harness.add_ratio(rows, "vs_eager", [(br.BLOCK_COMPILED, eager)])
    harness.add_ratio(rows, "vs_torchao_compiled", [(br.BLOCK_COMPILED, torchao)])
    assert [r.get("vs_eager") for r in rows] == [None, None, None, round(12.72 / 11.4, 3)]
    _write(tmp_path, "b.json", _bench("block", "2026-11-24", "NVIDIA H200", rows, baseline=base))
    table = br.bench_table("block", br.latest(br.load_runs(tmp_path))["block"])
    assert "| 11.40 ms (1.89x, 719k tok/s; 1.12x eager, 1.13x torchao compiled) |" in table
    assert f"{br.BLOCK_COMPILED} >= 1.1x its eager self: **met**" in table  # 1.116
    assert f"{br.BLOCK_COMPILED} >= 1.15x torchao compiled: **not met**" in table  # 1.134


def test_target_versus_another_variant_of_the_same_case(tmp_path):
    """A target with `versus` compares the named variant's ms with another variant's ms of the
    same case and run (bench_tp: graphed FP8 against graphed bf16), not with the baseline."""
    case, base = "B2 S4096 H4096 ffn14336 tp2 sp", "bf16 tp2 sp"
    times = ((base, 11.26), ("fp8 delayed tp2 sp", 9.74), ("bf16 tp2 sp graphed", 10.87),
             ("fp8 delayed tp2 sp graphed", 7.75))
    rows = [{"case": case, "variant": v, "ms": ms, f"speedup_vs_{base}": round(11.26 / ms, 3)}
            for v, ms in times]
    _write(tmp_path, "t.json", _bench("tp", "2026-11-27", "NVIDIA H200", rows, baseline=base))
    table = br.bench_table("tp", br.latest(br.load_runs(tmp_path))["tp"])
    assert ">= 1.4x bf16 TP=2: **not met**" in table  # 11.26 / 9.74 = 1.16
    assert "fp8 delayed tp2 sp graphed >= 1.4x bf16 TP=2 graphed: **met**" in table  # 1.403
    slower = [dict(r, ms=8.0) if r["variant"].startswith("fp8 delayed tp2 sp graphed") else r
              for r in rows]
    _write(tmp_path, "t.json", _bench("tp", "2026-11-27", "NVIDIA H200", slower, baseline=base))
    table = br.bench_table("tp", br.latest(br.load_runs(tmp_path))["tp"])
    assert "graphed >= 1.4x bf16 TP=2 graphed: **not met**" in table  # 10.87 / 8.0 = 1.36
    missing = [r for r in rows if r["variant"] != "bf16 tp2 sp graphed"]
    _write(tmp_path, "t.json", _bench("tp", "2026-11-27", "NVIDIA H200", missing, baseline=base))
    table = br.bench_table("tp", br.latest(br.load_runs(tmp_path))["tp"])
    assert "graphed >= 1.4x bf16 TP=2 graphed: n/a" in table


def test_fsdp_cells_show_exposed_communication_where_measured(tmp_path):
    """bench_fsdp's rows with the profiled exposed all-gather / reduce-scatter ms get them in the
    cell; rows written before those fields existed keep the shorter cell."""
    base = {"case": "llama3-8b-s4096-b4x4", "peak_gib_per_gpu": 38.2,
            "all_gather_gib_per_step": 28.0}
    rows = [dict(base, variant="bf16", ms=1856.2, tokens_per_s=35308.0, speedup_vs_bf16=1.0,
                 tokens_per_s_per_gpu=8827.0, all_gather_exposed_ms=41.4,
                 reduce_scatter_exposed_ms=12.6),
            dict(base, variant="tritium-fp8-delayed-ag", ms=1275.7, tokens_per_s=51372.0,
                 speedup_vs_bf16=1.455, all_gather_gib_per_step=15.0)]
    _write(tmp_path, "f.json", _bench("fsdp", "2026-11-27", "NVIDIA H200", rows, gpus=4))
    table = br.bench_table("fsdp", br.latest(br.load_runs(tmp_path))["fsdp"])
    assert ("| 35,308 tok/s (1.00x, 8,827 per GPU, 38.2 GiB, AG 28.0 GiB; exposed AG 41 + RS "
            "13 ms) |") in table
    assert "| 51,372 tok/s (1.46x, 38.2 GiB, AG 15.0 GiB) |" in table


def test_graphs_target_reads_the_paired_ratio_where_the_run_has_it(tmp_path):
    """Issue 19's FP8 / bf16 eager target reads the rounds' paired ratio (bench_graphs writes
    it as the bf16 row's paired_speedup), the ratio of the medians where a run has none."""
    case = "L4 H512 heads8 S128 B2, 1 micro-batch"
    base = "fp8 eager"

    def table(bf16_ms, paired):
        row = {"case": case, "variant": "bf16 eager", "ms": bf16_ms,
               f"speedup_vs_{base}": round(14.0 / bf16_ms, 3)}
        if paired is not None:
            row["paired_speedup"] = paired
        rows = [{"case": case, "variant": base, "ms": 14.0, f"speedup_vs_{base}": 1.0}, row]
        _write(tmp_path, "g.json", _bench("graphs", "2026-11-27", "NVIDIA H100", rows,
                                          baseline=base))
        return br.bench_table("graphs", br.latest(br.load_runs(tmp_path))["graphs"])
    label = "bf16 eager <= 1.3x (fp8 eager's time over its own)"
    t = table(10.0, 1.27)  # medians 1.40x apart, rounds 1.27x
    assert "10.00 ms (1.40x; paired 1.27x)" in t and f"{label}: **met**" in t
    t = table(11.5, 1.33)
    assert f"{label}: **not met**" in t
    t = table(11.5, None)  # an older run: the ratio of the medians, 1.22x
    assert "11.50 ms (1.22x)" in t and f"{label}: **met**" in t


def test_norm_wall_target_reads_the_default_threading_pair_only(tmp_path):
    """bench_norm times the fwd+bwd pair twice: with PyTorch's default threading (issue 19's
    target) and with the backward on the calling thread (shown, no target)."""
    label = "wall >= torch eager's (paired rounds)"
    case = "LayerNorm fwd+bwd 16384x4096"
    rows = []
    for suffix, ratio in (("", 0.9), (" | backward on calling thread", 1.4)):
        rows += [{"case": case + suffix, "variant": "torch eager paired", "ms": 0.33,
                  "paired_speedup": 1.0, "speedup_vs_torch eager": 1.0},
                 {"case": case + suffix, "variant": "tritium paired",
                  "ms": round(0.33 / ratio, 4), "paired_speedup": ratio,
                  "speedup_vs_torch eager": ratio}]
    _write(tmp_path, "n.json", _bench("norm", "2026-11-28", "NVIDIA H200", rows,
                                      baseline="torch eager"))
    table = br.bench_table("norm", br.latest(br.load_runs(tmp_path))["norm"])
    lines = {line.split(" | ")[0]: line for line in table.splitlines() if line.startswith("| ")}
    assert "0.90x torch eager's wall" in lines[f"| {case}"]
    assert f"{label}: **not met**" in lines[f"| {case}"]
    calling = lines[f"| {case} \\| backward on calling thread"]
    assert "1.40x torch eager's wall" in calling and label not in calling


def test_flash_targets_read_the_paired_ratio_where_the_run_has_it(tmp_path):
    """bench_flash_attention writes paired_speedup on the rows issue 26's targets compare (the
    FP8 kernel's forward, the speed mode's fwd+bwd); the cell shows it and the target reads it,
    the ratio of the two medians where a run has none."""
    case = "B4 H32 S4096 D128 causal fwd"

    def table(paired):
        fp8 = {"case": case, "variant": "tritium fp8 kernel", "ms": 0.75, "tflops": 730.0,
               "speedup_vs_sdpa cudnn": 1.24}
        if paired is not None:
            fp8["paired_speedup"] = paired
        rows = [{"case": case, "variant": "sdpa cudnn", "ms": 0.93, "tflops": 590.0,
                 "speedup_vs_sdpa cudnn": 1.0}, fp8]
        _write(tmp_path, "f.json", _bench("flash_attention", "2026-11-28", "NVIDIA H200", rows,
                                          baseline="sdpa cudnn"))
        return br.bench_table("flash_attention",
                              br.latest(br.load_runs(tmp_path))["flash_attention"])
    label = ">= 1.3x"  # the only tritium column here: the target reads without its name
    t = table(1.31)
    assert "0.750 ms (1.24x, paired 1.31x, 730 TFLOP/s)" in t and f"{label}: **met**" in t
    t = table(1.27)
    assert f"{label}: **not met**" in t
    t = table(None)
    assert "0.750 ms (1.24x, 730 TFLOP/s)" in t and f"{label}: **not met**" in t


def test_versus_target_reads_the_paired_ratio_where_the_run_has_it(tmp_path):
    """bench_model --rounds writes paired_vs_<peer>: a "versus" target reads it (the ratio of
    the rounds' own times) before the ratio of the two medians."""
    case = "Llama-3.2-1B B4 S2048"
    graphed = "tritium_fp8_delayed_fp8head_compile_cudagraphs"

    def table(paired):
        ours = {"case": case, "variant": graphed, "ms": 92.0, "peak_gib": 16.8,
                "speedup_vs_hf_eager": 1.76}
        if paired is not None:
            ours["paired_vs_hf_torchao"] = paired
        rows = [{"case": case, "variant": "hf_eager", "ms": 162.0, "speedup_vs_hf_eager": 1.0},
                {"case": case, "variant": "hf_torchao", "ms": 115.5, "peak_gib": 25.1,
                 "speedup_vs_hf_eager": 1.403}, ours]
        _write(tmp_path, "m.json", _bench("model", "2026-11-28", "NVIDIA H200", rows,
                                          baseline="hf_eager"))
        return br.bench_table("model", br.latest(br.load_runs(tmp_path))["model"])
    label = "; >= 1.25x hf_torchao"  # the only tritium column: the target reads without its name
    assert f"{label}: **met**" in table(None)   # medians 115.5 / 92.0 = 1.255x
    # README's summary row checks it the same way, with or without the paired ratio
    summary = br.summary_table(br.latest(br.load_runs(tmp_path)))
    assert ">= 1.25x hf_torchao: met" in summary
    t = table(1.246)
    assert f"{label}: **not met**" in t and "paired 1.246x hf_torchao" in t
    assert ">= 1.25x hf_torchao: not met" in br.summary_table(br.latest(br.load_runs(tmp_path)))
