"""`python -m tritium demo`: train a small Llama-style byte-level LM twice, high precision vs FP8.

What it does. Builds a decoder-only LM from tritium modules (nn.Embedding over 256 byte values,
N x te.TransformerLayer with RMSNorm, SwiGLU, RoPE and grouped-query attention, a final
te.RMSNorm and a te.Linear head), trains it twice from the same initial weights on the same
batches, once in high precision and once with the transformer blocks under te.fp8_autocast
(DelayedScaling by default), then prints a table (final train and held-out loss, tokens/s, peak
memory, FP8/high-precision ratios) and writes the loss curves (PNG with matplotlib, CSV always),
a results.json and a checkpoint of the last run to --out.

Precision. On a GPU both runs hold bf16 parameters (FusedAdam keeps fp32 master weights as
optimizer state when it is available; torch.optim.AdamW otherwise); on a CPU both hold fp32
parameters, because bf16 matmuls on a CPU are slow, and the FP8 GEMMs are emulated (the exact
FP8 values multiplied in fp32: the same numbers a GPU computes, not its speed). The embedding,
the final norm and the 256-wide head stay outside fp8_autocast (the usual practice of keeping
the first and last layers in high precision; they are a negligible share of the FLOPs).

Data. The default corpus is the source text of the Python standard library found at run time
(`sysconfig.get_paths()["stdlib"]`, *.py files in sorted path order, site-packages skipped),
capped at MAX_CORPUS_BYTES; --corpus takes any text file or folder instead. Bytes are the
tokens. The corpus is cut into equal chunks and every VAL_EVERY-th chunk is held out. Training
batches are random windows drawn from a generator seeded by --seed, so both runs see the same
batches; the held-out loss is taken on fixed, evenly spaced windows.

Ctrl-C stops the current run, saves `checkpoint.pt` (model and optimizer state_dicts, step,
config: loadable with torch.load(weights_only=True)), the curves of what ran, and exits 130.

Deliberately not here: data loaders, tokenizers, distributed training, config files.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import gc
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Optional

import torch

import tritium as te

VOCAB = 256
MAX_CORPUS_BYTES = 32 << 20
CHUNK_BYTES = 64 << 10
VAL_EVERY = 20
INIT_STD = 0.02
# Sizes per device type; any field can be overridden by its flag. The CPU preset finishes in
# about 2 minutes on 2 cores; the GPU preset is a ~0.83B-parameter model (12 x 69M per block)
# whose two runs take about 2.5 minutes on one H200. Hidden 2560 rather than 2048: the GEMMs are
# large enough for FP8 to pay (1.36x vs 1.23x tokens/s measured on an H200), and lr 2e-4 rather
# than 3e-4 keeps the loss curve smooth enough to compare two runs (benchmarks/RESULTS.md).
PRESETS = {
    "cpu": dict(layers=2, hidden=128, heads=4, kv_groups=2, ffn=352, seq_len=128, batch=8,
                steps=600, lr=2e-3, eval_batches=4),
    "cuda": dict(layers=12, hidden=2560, heads=20, kv_groups=4, ffn=6912, seq_len=2048, batch=8,
                 steps=400, lr=2e-4, eval_batches=8),
}


@dataclasses.dataclass
class Config:
    layers: int
    hidden: int
    heads: int
    kv_groups: int
    ffn: int
    seq_len: int
    batch: int
    steps: int
    lr: float
    eval_batches: int
    recipe: str = "delayed"
    corpus: Optional[str] = None
    seed: int = 0
    out: str = "demo_out"
    device: str = "cpu"

    @classmethod
    def from_args(cls, args) -> "Config":
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        values = dict(PRESETS["cuda" if device.startswith("cuda") else "cpu"])
        for f in dataclasses.fields(cls):
            given = getattr(args, f.name, None)
            if given is not None:
                values[f.name] = given
        values["device"] = device
        return cls(**values)

    def check(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_groups", "ffn", "seq_len", "batch",
                     "steps", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.hidden % self.heads or self.heads % self.kv_groups:
            raise ValueError(f"--hidden {self.hidden} must be a multiple of --heads {self.heads}, "
                             f"and --heads a multiple of --kv-groups {self.kv_groups}")
        head_dim = self.hidden // self.heads
        if head_dim % 2:
            raise ValueError(f"head dim hidden/heads = {head_dim} must be even (RoPE)")
        qkv = (self.heads + 2 * self.kv_groups) * head_dim
        bad = [f"{n}={v}" for n, v in (("hidden", self.hidden), ("ffn", self.ffn),
                                       ("qkv features", qkv)) if v % 16]
        if bad:
            raise ValueError("FP8 GEMMs need feature sizes divisible by 16: " + ", ".join(bad))


# --- data ---------------------------------------------------------------------------------

def _text_files(root: Path, suffix: Optional[str]):
    """Files under root in sorted path order, skipping hidden dirs, caches and site-packages."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip and not x.startswith("."))
        for name in sorted(files):
            if suffix is None or name.endswith(suffix):
                yield Path(d) / name


def load_corpus(path: Optional[str] = None, max_bytes: int = MAX_CORPUS_BYTES):
    """(bytes, description). path None: the stdlib's *.py files; a file; or a folder (every
    file in it that has no NUL byte in its first 1 KiB, i.e. looks like text)."""
    if path is None:
        root, suffix = Path(sysconfig.get_paths()["stdlib"]), ".py"
        what = "Python standard library source"
    else:
        root, suffix, what = Path(path), None, str(path)
        if not root.exists():
            raise FileNotFoundError(f"--corpus {path}: no such file or folder")
    files = [root] if root.is_file() else _text_files(root, suffix)
    parts, total, count = [], 0, 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        if root.is_dir() and b"\0" in data[:1024]:
            continue
        data = data[:max_bytes - total]
        parts.append(data)
        total, count = total + len(data), count + 1
        if total >= max_bytes:
            break
    return b"".join(parts), f"{what} ({count} files, {total / 2**20:.1f} MiB)"


def split_corpus(data: bytes, seq_len: int):
    """(train, val) uint8 tensors: equal chunks, every VAL_EVERY-th chunk held out."""
    n_chunks = max(VAL_EVERY, len(data) // CHUNK_BYTES)
    size = len(data) // n_chunks
    if size < seq_len + 1:
        raise ValueError(f"the corpus has {len(data)} bytes: too small for --seq-len {seq_len} "
                         f"(needs at least {VAL_EVERY * (seq_len + 1)} bytes)")
    t = torch.frombuffer(bytearray(data[:size * n_chunks]), dtype=torch.uint8).view(n_chunks, size)
    is_val = torch.arange(n_chunks) % VAL_EVERY == VAL_EVERY - 1
    return t[~is_val].reshape(-1).clone(), t[is_val].reshape(-1).clone()


def _windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int, device):
    idx = starts[:, None] + torch.arange(seq_len + 1)
    w = data[idx].to(device=device, dtype=torch.long, non_blocking=True)
    return w[:, :-1], w[:, 1:]


def train_batches(train: torch.Tensor, cfg: Config):
    """The same sequence of random windows for every run with the same seed."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    for _ in range(cfg.steps):
        starts = torch.randint(0, train.numel() - cfg.seq_len - 1, (cfg.batch,), generator=g)
        yield _windows(train, starts, cfg.seq_len, cfg.device)


def eval_batches(val: torch.Tensor, cfg: Config):
    n = cfg.eval_batches * cfg.batch
    starts = torch.linspace(0, val.numel() - cfg.seq_len - 1, n).long()
    return [_windows(val, s, cfg.seq_len, cfg.device) for s in starts.split(cfg.batch)]


# --- model --------------------------------------------------------------------------------

def _normal(std: float):
    return lambda w: torch.nn.init.normal_(w, mean=0.0, std=std)


class ByteLlama(torch.nn.Module):
    """Embedding -> N x te.TransformerLayer (Llama settings) -> te.RMSNorm -> te.Linear head."""

    def __init__(self, cfg: Config, dtype: torch.dtype):
        super().__init__()
        dev, head_dim = torch.device(cfg.device), cfg.hidden // cfg.heads
        self.embed = torch.nn.Embedding(VOCAB, cfg.hidden, device=dev, dtype=dtype)
        torch.nn.init.normal_(self.embed.weight, std=INIT_STD)
        self.rope = te.RotaryPositionEmbedding(head_dim).to(dev)
        out_init = _normal(INIT_STD / math.sqrt(2 * cfg.layers))  # GPT-2's residual scaling
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(cfg.hidden, cfg.ffn, cfg.heads, num_gqa_groups=cfg.kv_groups,
                                layernorm_epsilon=1e-5, hidden_dropout=0.0,
                                attention_dropout=0.0, normalization="RMSNorm",
                                activation="swiglu", bias=False, fuse_qkv_params=True,
                                qkv_weight_interleaved=False, attn_input_format="bshd",
                                self_attn_mask_type="causal", init_method=_normal(INIT_STD),
                                output_layer_init_method=out_init, params_dtype=dtype,
                                device=dev)
            for _ in range(cfg.layers))
        self.norm = te.RMSNorm(cfg.hidden, eps=1e-5, params_dtype=dtype, device=dev)
        self.head = te.Linear(cfg.hidden, VOCAB, bias=False, params_dtype=dtype, device=dev,
                              init_method=_normal(INIT_STD))

    def hidden(self, tokens: torch.Tensor, fp8_recipe=None) -> torch.Tensor:
        """The final normed hidden states, the lm_head's input."""
        x = self.embed(tokens)
        freqs = self.rope(tokens.shape[1])
        with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            for layer in self.layers:
                x = layer(x, rotary_pos_emb=freqs)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor, fp8_recipe=None) -> torch.Tensor:
        return self.head(self.hidden(tokens, fp8_recipe))


def _make_optimizer(params, lr: float, master_weights: bool):
    """tritium's FusedAdam when the package has it (fp32 master weights as optimizer state for
    16-bit params), else torch.optim.AdamW. Returns (optimizer, description)."""
    params = list(params)
    kw = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    try:
        from tritium.optimizers import FusedAdam
    except ImportError:
        FusedAdam = None
    if FusedAdam is not None:
        opt = FusedAdam(params, adam_w_mode=True, master_weights=master_weights, **kw)
        return opt, "tritium FusedAdam" + (" (fp32 master weights)" if master_weights else "")
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, fused=fused or None, **kw), "torch.optim.AdamW"


def _lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up over the first 10% (at most 100 steps), cosine decay to 10%."""
    warm = max(1, min(100, cfg.steps // 10))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


# --- training -----------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    name: str
    losses: list = dataclasses.field(default_factory=list)
    evals: list = dataclasses.field(default_factory=list)  # (step, held-out loss)
    tokens_per_s: float = float("nan")
    peak_mem_mib: Optional[float] = None
    interrupted: bool = False

    @property
    def final_train(self) -> float:
        tail = self.losses[-10:]
        return sum(tail) / len(tail) if tail else float("nan")

    @property
    def held_out(self) -> float:
        return self.evals[-1][1] if self.evals else float("nan")


class Progress:
    """One stderr line rewritten with \\r on a terminal (at most 10 times a second); a plain
    line every 10% of the steps otherwise (logs, CI)."""

    def __init__(self, name: str, total: int, stream=None):
        self.name, self.total = name, total
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.last = 0.0

    def update(self, step: int, loss: float, tok_s: Optional[float], force: bool = False):
        speed = f"{tok_s:,.0f} tok/s" if tok_s else "warm-up"
        line = f"[{self.name}] step {step}/{self.total}  loss {loss:.4f}  {speed}"
        now = time.monotonic()
        if self.tty:
            if force or now - self.last > 0.1:
                self.stream.write("\r" + line.ljust(72))
                self.stream.flush()
                self.last = now
        elif force or step % max(1, self.total // 10) == 0:
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self):
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loss(model, x, y, fp8_recipe) -> torch.Tensor:
    """Mean next-byte cross-entropy, fused with the head GEMM (no logits tensor)."""
    return te.linear_cross_entropy(model.hidden(x, fp8_recipe), model.head.weight, y)


@torch.no_grad()
def evaluate(model, batches, fp8_recipe) -> float:
    """Mean held-out loss, in the precision the model trains in."""
    losses = [_loss(model, x, y, fp8_recipe) for x, y in batches]
    return torch.stack(losses).mean().item()


def train_run(run: Run, model, opt, cfg: Config, batches, val_batches, fp8_recipe) -> Run:
    """Train in place; fills `run`. The loss of step i is read after step i+1 is queued, so
    the GPU never waits for the host. Tokens/s leave out the first steps (Triton compiles,
    allocator warm-up) and the evaluations. Ctrl-C ends the run early (run.interrupted)."""
    device = torch.device(cfg.device)
    warm = min(3, cfg.steps - 1)
    eval_every = max(1, cfg.steps // 5)
    tokens = cfg.batch * cfg.seq_len
    progress = Progress(run.name, cfg.steps)
    t0, paused, pending = None, 0.0, None

    def rate():
        if t0 is None or len(run.losses) <= warm:
            return None
        return (len(run.losses) - warm) * tokens / max(time.perf_counter() - t0 - paused, 1e-9)

    def record(step, loss):
        run.losses.append(loss.item())
        progress.update(step, run.losses[-1], rate(), force=step == cfg.steps)

    try:
        for step, (x, y) in enumerate(batches):
            if step == warm:
                _sync(device)
                t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, cfg)
            loss = _loss(model, x, y, fp8_recipe)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if pending is not None:
                record(step, pending)
            pending = loss.detach()
            if (step + 1) % eval_every == 0 or step + 1 == cfg.steps:
                record(step + 1, pending)
                pending = None
                _sync(device)
                t = time.perf_counter()
                run.evals.append((step + 1, evaluate(model, val_batches, fp8_recipe)))
                if t0 is not None:
                    paused += time.perf_counter() - t
    except KeyboardInterrupt:
        run.interrupted = True
    if pending is not None:
        record(len(run.losses) + 1, pending)
    _sync(device)
    run.tokens_per_s = rate() or float("nan")
    progress.close()
    if run.interrupted and run.losses and (not run.evals or run.evals[-1][0] != len(run.losses)):
        try:  # a held-out point for what ran; a second Ctrl-C skips it
            run.evals.append((len(run.losses), evaluate(model, val_batches, fp8_recipe)))
        except KeyboardInterrupt:
            pass
    if device.type == "cuda":
        run.peak_mem_mib = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        run.peak_mem_mib = _max_rss_mib()
    return run


def _max_rss_mib() -> Optional[float]:
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB else


# --- report -------------------------------------------------------------------------------

def _fmt_mem(mib: Optional[float]) -> str:
    if mib is None:
        return "n/a"
    return f"{mib / 1024:.2f} GiB" if mib >= 1024 else f"{mib:.0f} MiB"


def _ratio(a, b) -> str:
    ok = a is not None and b is not None and a == a and b == b and b != 0
    return f"{a / b:.3f}x" if ok else "n/a"


def table(runs: list, device: torch.device) -> str:
    """Markdown table: one row per run, then FP8 / high-precision ratios."""
    mem = "peak GPU memory" if device.type == "cuda" else "process max RSS"
    lines = [f"| run | final train loss | held-out loss | tokens/s | {mem} |",
             "|---|---|---|---|---|"]
    for r in runs:
        note = " (interrupted)" if r.interrupted else ""
        lines.append(f"| {r.name}{note} | {r.final_train:.4f} | {r.held_out:.4f} | "
                     f"{r.tokens_per_s:,.0f} | {_fmt_mem(r.peak_mem_mib)} |")
    if len(runs) == 2:
        hp, f8 = runs
        mem_ratio = _ratio(f8.peak_mem_mib, hp.peak_mem_mib) if device.type == "cuda" else "n/a"
        lines.append(f"| {f8.name} / {hp.name} | {_ratio(f8.final_train, hp.final_train)} | "
                     f"{_ratio(f8.held_out, hp.held_out)} | "
                     f"{_ratio(f8.tokens_per_s, hp.tokens_per_s)} | {mem_ratio} |")
    return "\n".join(lines)


def write_curves(out: Path, runs: list, title: str) -> list:
    """loss_curves.csv always; loss_curves.png when matplotlib is importable."""
    from ._plot import loss_curves
    csv_path = out / "loss_curves.csv"
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "step", "train_loss", "held_out_loss"])
        for r in runs:
            held = dict(r.evals)
            for i, v in enumerate(r.losses, 1):
                w.writerow([r.name, i, f"{v:.6f}", f"{held[i]:.6f}" if i in held else ""])
    png = loss_curves(out / "loss_curves.png", {r.name: r.losses for r in runs},
                      {r.name: r.evals for r in runs}, title)
    return [p for p in (png, csv_path) if p is not None]


def save_checkpoint(path: Path, model, opt, run: Run, cfg: Config) -> Path:
    """Plain tensors and values only: torch.load(path, weights_only=True) loads it."""
    torch.save({"run": run.name, "step": len(run.losses), "config": dataclasses.asdict(cfg),
                "model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return path


# --- the command --------------------------------------------------------------------------

def _recipe(name: str):
    fmt = te.recipe.Format.HYBRID
    if name == "delayed":
        return te.recipe.DelayedScaling(fp8_format=fmt, amax_history_len=16,
                                        amax_compute_algo="max")
    if name == "block":  # TE's defaults: E4M3 in both passes, 1x128 / 128x128 blocks
        return te.recipe.Float8BlockScaling()
    if name == "mxfp8":  # emulated on every device
        return te.recipe.MXFP8BlockScaling()
    return te.recipe.Float8CurrentScaling(fp8_format=fmt)


def run_demo(cfg: Config) -> int:
    cfg.check()
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda given but torch sees no CUDA GPU", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hp_name = "bf16" if dtype == torch.bfloat16 else "fp32"
    data, corpus_desc = load_corpus(cfg.corpus)
    train, val = split_corpus(data, cfg.seq_len)
    val_batches = eval_batches(val, cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    fp8_recipe = _recipe(cfg.recipe)
    from ._device import fp8_gemm_support
    fp8_ok, why = fp8_gemm_support(device)
    if cfg.recipe == "mxfp8":
        fp8_ok, why = False, "MXFP8 is emulated on every device"

    torch.manual_seed(cfg.seed)
    model = ByteLlama(cfg, dtype)
    init_state = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                  for k, v in model.state_dict().items()}
    n_params = sum(p.numel() for p in model.parameters())
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"tritium {te.__version__} demo on {dev_name} ({device}, torch {torch.__version__})")
    print(f"model: byte-level Llama, {n_params / 1e6:.3g}M params: {cfg.layers} x "
          f"te.TransformerLayer(hidden {cfg.hidden}, ffn {cfg.ffn}, {cfg.heads} heads, "
          f"{cfg.kv_groups} KV groups; RMSNorm, SwiGLU, RoPE), {hp_name} params")
    print(f"data: {corpus_desc}; {train.numel():,} train / {val.numel():,} held-out bytes")
    print(f"training: {cfg.steps} steps x {cfg.batch} x {cfg.seq_len} tokens, lr {cfg.lr} "
          f"(warm-up, cosine), seed {cfg.seed}; FP8: {type(fp8_recipe).__name__} "
          f"{fp8_recipe.fp8_format.name}, GEMMs "
          f"{'on tensor cores' if fp8_ok else 'emulated'} ({why})", flush=True)

    runs, status, model_opt = [], 0, None
    for name, recipe in ((hp_name, None), (f"fp8 {cfg.recipe}", fp8_recipe)):
        if model is None:
            model = ByteLlama(cfg, dtype)
            model.load_state_dict(init_state)
        opt, opt_name = _make_optimizer(model.parameters(), cfg.lr,
                                        master_weights=dtype != torch.float32)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        run = train_run(Run(name), model, opt, cfg, train_batches(train, cfg), val_batches,
                        recipe)
        runs.append(run)
        model_opt = (model, opt)
        if run.interrupted:
            status = 130
            break
        if name != f"fp8 {cfg.recipe}":
            del model, opt, model_opt
            model = model_opt = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    title = (f"{n_params / 1e6:.3g}M-param byte Llama, {cfg.steps} steps x {cfg.batch * cfg.seq_len}"
             f" tokens, {dev_name}")
    files = write_curves(out, runs, title)
    ckpt = save_checkpoint(out / "checkpoint.pt", *model_opt, runs[-1], cfg)
    result = {"config": dataclasses.asdict(cfg), "device": dev_name, "params": n_params,
              "optimizer": opt_name, "fp8_gemms": "tensor cores" if fp8_ok else "emulated",
              "corpus": corpus_desc,
              "runs": [dict(name=r.name, final_train_loss=r.final_train, held_out_loss=r.held_out,
                            tokens_per_s=r.tokens_per_s, peak_mem_mib=r.peak_mem_mib,
                            interrupted=r.interrupted, steps=len(r.losses), evals=r.evals,
                            losses=r.losses) for r in runs]}
    (out / "results.json").write_text(json.dumps(result, indent=1))

    print("\n" + table(runs, device) + "\n")
    print(f"optimizer: {opt_name}; final train loss = mean of the last 10 steps; held-out loss "
          f"on {cfg.eval_batches * cfg.batch} fixed windows; tokens/s leave out the first steps "
          "and the evaluations")
    if device.type != "cuda":
        print("CPU: FP8 GEMMs are emulated, so FP8 tokens/s measure the emulation, not FP8 speed; "
              "memory is the whole process's peak RSS so far (both runs)")
    if not any(p.suffix == ".png" for p in files):
        print("matplotlib is not installed (pip install matplotlib): curves written as CSV only")
    size = ckpt.stat().st_size / 2**20
    print("wrote " + ", ".join(str(p) for p in files + [out / "results.json"])
          + f", {ckpt} ({_fmt_mem(size)}, {runs[-1].name} at step {len(runs[-1].losses)})")
    if status == 130:
        print("interrupted: the checkpoint and the curves hold what ran", file=sys.stderr)
        return status
    if not all(math.isfinite(v) for r in runs for v in (r.final_train, r.held_out)):
        print("a run ended with a non-finite loss: that is a bug, not FP8 noise; rerun with "
              "TRITIUM_FORCE_REF=1 to compare with the reference path, and report it")
        return 1
    return 0


def add_arguments(p) -> None:
    """The demo's flags (cli.py); None = the device's preset (PRESETS)."""
    for flag, typ, what in (("--layers", int, "transformer layers"), ("--hidden", int, "hidden size"),
                            ("--heads", int, "attention heads"),
                            ("--kv-groups", int, "KV heads (GQA groups)"),
                            ("--ffn", int, "MLP hidden size"), ("--seq-len", int, "tokens per sequence"),
                            ("--batch", int, "sequences per step"),
                            ("--steps", int, "training steps per run"),
                            ("--lr", float, "peak learning rate"),
                            ("--eval-batches", int, "held-out batches per evaluation")):
        dest = flag[2:].replace("-", "_")
        p.add_argument(flag, type=typ, default=None, dest=dest,
                       help=f"{what} (CPU {PRESETS['cpu'][dest]}, GPU {PRESETS['cuda'][dest]})")
    p.add_argument("--recipe", choices=("delayed", "current", "block", "mxfp8"),
                   default="delayed",
                   help="FP8 recipe: DelayedScaling (default), Float8CurrentScaling, "
                        "Float8BlockScaling or MXFP8BlockScaling (emulated)")
    p.add_argument("--corpus", default=None,
                   help="a text file or folder (default: the Python standard library's source)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    p.add_argument("--out", default="demo_out", help="output folder (default demo_out)")
    p.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda if present)")


def main(args) -> int:
    try:
        return run_demo(Config.from_args(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"tritium demo: {exc}", file=sys.stderr)
        return 2
