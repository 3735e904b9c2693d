"""`understudy train-head`: train the target's own prediction head for method="eagle".

    understudy train-head                            # default target, stdlib corpus, cache
    understudy train-head --target T --out DIR --data my_code/ --tokens 100000
    understudy train-head --tokens 0 --self-tokens 122880 --init HEAD --out DIR
                                                     # text the target writes, from a head
    understudy train-head --tokens 0 --self-tokens 368640 --opener-tokens 196608
                                                     # ... also in other languages

The target runs once over the corpus (its features are cached in the output folder), then
the head trains on the cache. Interrupt it at will: run the same command again and it
resumes (extracted shards are kept, training continues from its last checkpoint).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from understudy.head.shards import SHARD


def whole_shards(count: int) -> int:
    """At least 2 sequences, rounded up to whole shards past one shard."""
    count = max(2, count)
    return -(-count // SHARD) * SHARD if count > SHARD else count


def train_head_command(
    target: Annotated[
        str | None, typer.Option(help="Target model (default: the packaged default target).")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Output folder. Default: the cache, where method=eagle finds it."),
    ] = None,
    data: Annotated[
        list[Path] | None,
        typer.Option(
            help="Training text: files or folders (.py/.md/.txt). Default: the "
            "Python standard library's source."
        ),
    ] = None,
    tokens: Annotated[
        int,
        typer.Option(
            help="Corpus tokens to train on (the 1.5B target reads ~80-110 tokens/s on a 2-core CPU)."
        ),
    ] = 163840,
    seq_len: Annotated[int, typer.Option(help="Tokens per training sequence.")] = 512,
    self_tokens: Annotated[
        int,
        typer.Option(
            help="Also train on text the target writes itself, this many tokens: standard "
            "library docstrings as prompts, continued greedily (~280-320 tokens/s, batched, on a 2-core AMX CPU)."
        ),
    ] = 0,
    opener_tokens: Annotated[
        int,
        typer.Option(
            help="Also train on this many tokens the target writes from file openers in many "
            "languages (JavaScript, C, Go, Rust, SQL, ...): it samples the rest of each prompt "
            "(48 tokens), then continues greedily."
        ),
    ] = 0,
    chat_tokens: Annotated[
        int,
        typer.Option(
            help="Also train on this many tokens the target writes answering chat requests "
            "about standard-library functions (explain, review, edit, test, translate one): "
            "its chat template, prose and code, for chat and editing requests."
        ),
    ] = 0,
    self_len: Annotated[
        int, typer.Option(help="Tokens per self-written sequence (a divisor of --seq-len).")
    ] = 256,
    init: Annotated[
        Path | None,
        typer.Option(
            help="Start from this trained head instead of a fresh one: its folder, or a "
            "packed head's file (the package's: `understudy inspect TARGET --json`'s eagle_head)."
        ),
    ] = None,
    epochs: Annotated[int, typer.Option(help="Passes over the corpus.")] = 6,
    batch: Annotated[int, typer.Option(help="Sequences per optimizer step.")] = 2,
    lr: Annotated[float, typer.Option(help="Peak learning rate (warm-up, then cosine).")] = 6e-4,
    unroll: Annotated[int, typer.Option(help="Drafting steps unrolled in training.")] = 2,
    feature_noise: Annotated[
        float,
        typer.Option(help="Uniform noise on the input features, in feature stds (0 = off)."),
    ] = 0.0,
    precision: Annotated[
        str,
        typer.Option(
            help="Training matmuls: auto (bfloat16 where the hardware has it), float32, bfloat16."
        ),
    ] = "auto",
    intermediate_size: Annotated[int, typer.Option(help="The head's MLP width.")] = 4096,
    draft_vocab: Annotated[int, typer.Option(help="Tokens the head can guess.")] = 8192,
    feature_layers: Annotated[
        str,
        typer.Option(
            help="What the head reads: auto (EAGLE-3: a low, a middle and the last layer's "
            "outputs), final (the final hidden state alone), or layer indices: 1,13,27."
        ),
    ] = "auto",
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
) -> None:
    """Train the target's own prediction head (EAGLE-style) on its hidden states."""
    from understudy.cli.common import fail
    from understudy.config import UnderstudyError
    from understudy.drafters.eagle import default_head_dir
    from understudy.head.pipeline import HeadSettings, train_head
    from understudy.head.train import TrainConfig
    from understudy.models.hf_fallback import refuse_on_fallback
    from understudy.models.loader import load_model
    from understudy.models.registry import DEFAULT_TARGET

    sizes = TextSizes(tokens, seq_len, self_tokens, opener_tokens, self_len, chat_tokens)
    problem = sizes.problem() or _option_problem(
        epochs, batch, unroll, intermediate_size, draft_vocab, init, lr, feature_noise, precision
    )
    layers = parse_feature_layers(feature_layers)
    if problem is None and layers is False:
        problem = f"--feature-layers must be auto, final or layer indices, got {feature_layers!r}"
    if problem:
        fail(problem)
    train_cfg = TrainConfig(
        epochs=epochs,
        batch=batch,
        lr=lr,
        unroll=unroll,
        feature_noise=feature_noise,
        precision=precision,
    )
    err = Console(stderr=True, highlight=False)
    try:
        loaded = load_model(target or DEFAULT_TARGET)
        refuse_on_fallback(loaded, None, wants_hidden=True)  # a head reads hidden states
        if loaded.tokenizer is None:
            raise UnderstudyError(f"target {loaded.name!r} has no tokenizer: cannot read text")
        text = training_text(loaded.tokenizer, data, sizes)
        folder = out or default_head_dir(loaded.name)
        own = (len(text.prompts) + len(text.openers) + len(text.chats)) * self_len
        written = f" + {own} the target writes" if own else ""
        err.print(
            f"training a head for {loaded.name} on {len(text.sequences) * seq_len} tokens "
            f"({text.corpus}){written}; output: {folder}"
        )
        settings = HeadSettings(
            intermediate_size=intermediate_size,
            draft_vocab_size=draft_vocab,
            train=train_cfg,
            self_len=self_len,
            feature_layers=layers,
        )
        meta = train_head(
            loaded, text.sequences, folder, text.corpus, settings, progress, text.prompts,
            init, text.openers, text.chats,
        )  # fmt: skip
    except (UnderstudyError, FileNotFoundError, ValueError) as error:
        fail(str(error))
        return
    summary = {
        k: meta[k]
        for k in ("tokens", "train_seconds", "val_agree", "draft_vocab_coverage_held_out")
    }
    err.print(json.dumps(summary))
    use = "understudy generate --method eagle" + (f" --draft {folder}" if out else "")
    err.print(f"saved to {folder}; use it with: {use} 'def fib(n):'")


@dataclass(frozen=True)
class TextSizes:
    """How much text a head trains on: corpus tokens in sequences of seq_len, and text the
    target writes itself (from docstrings; from file openers; answering chat requests) in
    sequences of self_len."""

    tokens: int
    seq_len: int
    self_tokens: int
    opener_tokens: int
    self_len: int
    chat_tokens: int = 0

    def problem(self) -> str | None:
        """The first option out of range, as a one-line message, or None."""
        from understudy.head.self_text import OPENER_SAMPLED

        for name, value, low in (
            ("self-tokens", self.self_tokens, 0),
            ("opener-tokens", self.opener_tokens, 0),
            ("chat-tokens", self.chat_tokens, 0),
            ("seq-len", self.seq_len, 16),
            ("self-len", self.self_len, 16),
        ):
            if value < low:
                return f"--{name} must be at least {low}, got {value}"
        written = self.self_tokens or self.opener_tokens or self.chat_tokens
        if self.tokens < 2 * self.seq_len and (self.tokens or not written):
            return (
                f"--tokens must be at least {2 * self.seq_len} (or 0 with --self-tokens, "
                f"--opener-tokens or --chat-tokens), got {self.tokens}"
            )
        if written and self.tokens and self.seq_len % self.self_len:
            return f"--seq-len {self.seq_len} must be a multiple of --self-len {self.self_len}"
        for name, value in (
            ("self-tokens", self.self_tokens),
            ("opener-tokens", self.opener_tokens),
            ("chat-tokens", self.chat_tokens),
        ):
            if value and value < 2 * self.self_len:
                return f"--{name} must be 0 or at least {2 * self.self_len}, got {value}"
        if self.opener_tokens and self.self_len <= OPENER_SAMPLED + 16:
            return (
                f"--self-len must be over {OPENER_SAMPLED + 16} with --opener-tokens "
                f"({OPENER_SAMPLED} are sampled), got {self.self_len}"
            )
        return None


def _option_problem(
    epochs: int, batch: int, unroll: int, intermediate_size: int, draft_vocab: int,
    init: Path | None, lr: float, feature_noise: float, precision: str,
) -> str | None:  # fmt: skip
    """The first training option out of range, as a one-line message, or None."""
    from understudy.head.train import PRECISIONS

    for name, value, low in (
        ("epochs", epochs, 1),
        ("batch", batch, 1),
        ("unroll", unroll, 1),
        ("intermediate-size", intermediate_size, 8),
        ("draft-vocab", draft_vocab, 2),
    ):
        if value < low:
            return f"--{name} must be at least {low}, got {value}"
    if init is not None and not (init.is_file() or (init / "head.safetensors").is_file()):
        return f"--init {init}: no trained head there (head.safetensors) and not a packed head"
    if not lr > 0:
        return f"--lr must be positive, got {lr}"
    if not feature_noise >= 0:
        return f"--feature-noise must be >= 0, got {feature_noise}"
    if precision not in PRECISIONS:
        return f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}"
    return None


@dataclass(frozen=True)
class TrainingText:
    """The token sequences a head trains on, the prompts the target continues itself
    (docstrings, file openers, chat requests), and the corpus's name (its features' cache
    key)."""

    sequences: list[list[int]]
    prompts: list[list[int]]
    openers: list[list[int]]
    corpus: str
    chats: list[list[int]]


def training_text(tokenizer: Any, data: list[Path] | None, sizes: TextSizes) -> TrainingText:
    """The corpus (`data`'s files, or the standard library's source) cut into sequences, and
    the docstring, opener and chat prompts; UnderstudyError where there is too little."""
    from understudy.config import UnderstudyError
    from understudy.head.corpus import stdlib_files, text_files, token_sequences
    from understudy.head.self_text import chat_prompts, docstring_prompts, opener_prompts

    if data:
        files = text_files(list(data))
        key = hashlib.sha256("\n".join(str(f) for f in sorted(files)).encode()).hexdigest()
        corpus = f"data{key[:10]}"
    else:
        files, corpus = stdlib_files(), "stdlib"
    if not files:
        raise UnderstudyError("the training data holds no readable .py/.md/.txt files")
    sequences: list[list[int]] = []
    if sizes.tokens:
        count = whole_shards(sizes.tokens // sizes.seq_len)
        sequences = list(token_sequences(files, tokenizer, sizes.seq_len, count))
        if len(sequences) < 2:
            raise UnderstudyError(f"the training data holds under {2 * sizes.seq_len} tokens")
    prompts: list[list[int]] = []
    if sizes.self_tokens:
        count = whole_shards(sizes.self_tokens // sizes.self_len)
        prompts = docstring_prompts(stdlib_files(), tokenizer, count, sizes.self_len - 1)
        if len(prompts) < 2:
            raise UnderstudyError("found under 2 docstring prompts shorter than --self-len")
    openers: list[list[int]] = []
    if sizes.opener_tokens:
        openers = opener_prompts(tokenizer, whole_shards(sizes.opener_tokens // sizes.self_len))
    chats: list[list[int]] = []
    if sizes.chat_tokens:
        count = whole_shards(sizes.chat_tokens // sizes.self_len)
        chats = chat_prompts(stdlib_files(), tokenizer, count, sizes.self_len - 1)
        if len(chats) < 2:
            raise UnderstudyError("found under 2 chat prompts shorter than --self-len")
    return TrainingText(sequences, prompts, openers, corpus, chats)


def parse_feature_layers(text: str) -> tuple[int, ...] | None | bool:
    """--feature-layers: None for auto (the target's default), () for final, the indices
    given ascending; False when it is none of those."""
    if text == "auto":
        return None
    if text == "final":
        return ()
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        return False
    return layers if list(layers) == sorted(set(layers)) and min(layers) >= 0 else False


def pack_head_command(
    folder: Annotated[Path, typer.Argument(help="A trained head's folder (train-head --out).")],
    out: Annotated[
        Path | None,
        typer.Option(help="The packed file. Default: the package's own head, shipped with it."),
    ] = None,
) -> None:
    """Pack a trained head (int4) to ship it: method=eagle then finds it for its target file."""
    from understudy.cli.common import fail
    from understudy.config import UnderstudyError
    from understudy.models.eagle_head import CONFIG_FILE, read_head_config
    from understudy.models.head_file import pack_head, shipped_head

    if not (folder / CONFIG_FILE).is_file():
        fail(f"{folder} holds no trained head ({CONFIG_FILE})")
        return
    _, meta = read_head_config(folder)
    sha256 = meta.get("target_sha256")
    if not isinstance(sha256, str):
        fail(f"{folder}: its config.json names no target file's sha256 (train it again)")
        return
    target = out or shipped_head()
    try:
        size = pack_head(folder, target, sha256)
    except UnderstudyError as error:
        fail(str(error))
        return
    Console(stderr=True, highlight=False).print(
        f"packed {folder} into {target} ({size / 2**20:.1f} MB) for {meta.get('target')!r} "
        f"(sha256 {sha256[:16]}...)"
    )
