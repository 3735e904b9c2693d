"""Shared fixtures: tiny randomly initialised Qwen2 models saved as Hugging Face directories.

The draft is the target with small noise added to every weight, so it agrees with the target
most of the time but not always: both the accept and the reject paths run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY_VOCAB = 320


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run their passes fastest on one thread, and on a busy 2-core machine
    OpenMP's barrier makes each pass wait for a descheduled second thread; no result checked
    with it depends on the thread count. Modules that want it say
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_tiny_tokenizer(out_dir: Path) -> None:
    """A small byte-level BPE tokenizer trained on a few lines of code (no network)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB - 2,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [
        "def add(a, b):\n    return a + b\n",
        "for i in range(10):\n    print(i)\n",
        "The quick brown fox jumps over the lazy dog.",
        "class Stack:\n    def push(self, x):\n        self.items.append(x)\n",
    ] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_end|>{{ m['role'] }}\n{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|im_end|>assistant\n{% endif %}"
    )
    fast.save_pretrained(out_dir)


def make_tiny_pair(
    root: Path,
    seed: int = 0,
    noise: float = 0.05,
    tokenizer: bool = True,
    lm_head_scale: float = 10.0,
) -> tuple[str, str]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=0,
    )
    target = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # a larger LM head: peaked, input-dependent next-token distributions
        target.lm_head.weight.mul_(lm_head_scale)
    draft = Qwen2ForCausalLM(config).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * p.std() * torch.randn_like(p))  # noise relative to each weight
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        path = root / name
        model.save_pretrained(path)
        if tokenizer:
            make_tiny_tokenizer(path)
        paths.append(str(path))
    return paths[0], paths[1]


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[str, str]:
    return make_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_pair_no_tokenizer(tmp_path_factory) -> tuple[str, str]:
    return make_tiny_pair(tmp_path_factory.mktemp("tiny_notok"), seed=1, tokenizer=False)


@pytest.fixture(scope="module")
def engine(tiny_pair):
    """The tiny pair as an engine, one per test module: method draft, K = 2 (float32 CPU
    passes hold 3 rows, so greedy output stays exact). A module that needs another engine
    defines its own `engine` fixture."""
    from understudy.engine.engine import Engine

    target, draft = tiny_pair
    return Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", num_speculative_tokens=2
    )
