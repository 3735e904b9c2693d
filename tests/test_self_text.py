"""Training text the target writes itself (head/self_text.py), and training on it.

Packed batches must decode each sequence exactly as plain greedy decoding would, with the
features a full pass gives (a row that saw another sequence's slots would not); docstring
prompts are the signature and docstring of documented functions, chat prompts ask something
of a whole function in the chat template; `train_head` trains on self-written text, alone or
beside a corpus, and `init` starts from a trained head.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from eagle_helpers import SETTINGS, target_written_text
from test_cli import cli
from understudy import Engine, SamplingParams
from understudy.head.features import target_features
from understudy.head.lockstep import decode_in_lockstep
from understudy.head.pipeline import HeadSettings, train_head
from understudy.head.self_text import (
    CHAT_ASKS,
    LENGTH_RUN,
    OPENERS,
    chat_prompts,
    docstring_prompts,
    function_prompts,
    function_sources,
)
from understudy.head.train import TrainConfig
from understudy.models.loader import load_model

SOURCE = '''
import functools


class Store:
    @functools.cache
    def get(self, key: str) -> int:
        """Return the value stored under key, or raise KeyError."""
        return self.items[key]

    def short(self):
        """Too short."""
        return 1


def undocumented(x):
    return x


async def fetch(url):
    """Fetch url and return its body as bytes.

    Retries twice on a timeout.
    """
    return await get(url)
'''


def test_function_prompts_are_signature_and_docstring():
    prompts = list(function_prompts(SOURCE))
    assert sorted(prompts) == sorted(
        [
            "@functools.cache\ndef get(self, key: str) -> int:\n"
            '    """Return the value stored under key, or raise KeyError."""\n',
            'async def fetch(url):\n    """Fetch url and return its body as bytes.\n\n'
            '    Retries twice on a timeout.\n    """\n',
        ]
    )
    assert list(function_prompts("def broken(:\n")) == []


def test_function_sources_are_whole_documented_functions():
    sources = list(function_sources(SOURCE))
    assert sorted(sources) == sorted(
        [
            "@functools.cache\ndef get(self, key: str) -> int:\n"
            '    """Return the value stored under key, or raise KeyError."""\n'
            "    return self.items[key]",
            'async def fetch(url):\n    """Fetch url and return its body as bytes.\n\n'
            '    Retries twice on a timeout.\n    """\n    return await get(url)',
        ]
    )


def test_chat_prompts_ask_of_whole_functions_in_the_chat_template(tiny_pair, tmp_path):
    """Each chat prompt is the tokenizer's chat template (the assistant's turn open) around
    one user message: an ask of CHAT_ASKS and one whole function in a fence; none passes
    max_tokens, every ask is made, and a smaller limit's list is a prefix of a larger one's
    (across a run boundary: cached shards stay valid when more text is asked for)."""
    from transformers import AutoTokenizer

    target, _ = tiny_pair
    tokenizer = AutoTokenizer.from_pretrained(target)
    source = "".join(
        f'def f{i}(x):\n    """Return x plus {i}, checked."""\n    return x + {i}\n\n'
        for i in range(LENGTH_RUN + 100)
    )
    (tmp_path / "many.py").write_text(source)
    files = [tmp_path / "many.py"]
    many = chat_prompts(files, tokenizer, 10**6, max_tokens=159)
    assert LENGTH_RUN + 10 < len(many) and len({tuple(p) for p in many}) == len(many)
    asked = dict.fromkeys(CHAT_ASKS, 0)
    for ids in many:
        assert len(ids) <= 159
        text = tokenizer.decode(ids)
        number = text.split("def f")[1].split("(")[0]
        ask = next(ask for ask in CHAT_ASKS if ask in text)
        asked[ask] += 1
        message = (
            f'{ask}\n\n```python\ndef f{number}(x):\n    """Return x plus {number}, checked."""'
            f"\n    return x + {number}\n```"
        )
        wrapped = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}],
            add_generation_prompt=True, tokenize=True, return_dict=True,
        )  # fmt: skip
        assert ids == list(wrapped["input_ids"])
    assert min(asked.values()) > 0
    for limit in (7, LENGTH_RUN + 3):
        assert chat_prompts(files, tokenizer, limit, max_tokens=159) == many[:limit]
    assert chat_prompts(files, tokenizer, 10, max_tokens=20) == []  # all longer than 20


def test_more_prompts_extend_fewer(tiny_pair, tmp_path):
    """Asking for more text keeps the prompts (and so the cached shards) of less: the list
    for a smaller limit is a prefix of a larger one's, across a run boundary."""
    from transformers import AutoTokenizer

    target, _ = tiny_pair
    tokenizer = AutoTokenizer.from_pretrained(target)
    source = "".join(
        f'def f{i}(x):\n    """Return x {"plus" if i % 2 else "times"} {i} for the caller."""\n'
        f"    return x + {i}\n\n"
        for i in range(LENGTH_RUN + 40)
    )
    (tmp_path / "many.py").write_text(source)
    files = [tmp_path / "many.py"]
    many = docstring_prompts(files, tokenizer, LENGTH_RUN + 40)
    assert len(many) == LENGTH_RUN + 40 and len({tuple(p) for p in many}) == len(many)
    for limit in (10, LENGTH_RUN - 5, LENGTH_RUN + 7):
        assert docstring_prompts(files, tokenizer, limit) == many[:limit]


def test_packed_batches_decode_as_plain_greedy(tiny_pair):
    """Sequences of different prompt lengths, decoded together, hold plain decoding's greedy
    tokens, and their features and argmax are those of one full pass over each."""
    target, _ = tiny_pair
    model = load_model(target, "float32").model
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 300, (n,), generator=gen).tolist() for n in (3, 9, 5, 17, 9)]
    decoded = decode_in_lockstep(model, prompts, 40)
    tokens, features, argmax = decoded.tokens, decoded.features, decoded.argmax
    assert tokens.shape == (5, 40) and features.shape == (5, 40, model.cfg.hidden_size)
    plain = Engine.from_pretrained(target=target, method="none", dtype="float32")
    for b, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=40 - len(prompt), temperature=0.0, ignore_eos=True)
        assert tokens[b].tolist() == prompt + plain.generate(prompt, params).token_ids
        full, full_argmax = target_features(model, tokens[b])
        torch.testing.assert_close(features[b], full, atol=1e-4, rtol=1e-4)
        assert torch.equal(argmax[b], full_argmax)
        assert torch.equal(argmax[b, len(prompt) - 1 : -1], tokens[b, len(prompt) :])


def test_region_attention_is_each_rows_own_keys(tiny_pair):
    """Batch work's attention (`regions`: row r over cache slots r * T .. r * T + L - 1, one
    batched SDPA call over views) equals, row by row, the per-row path over those slots
    gathered explicitly (`key_slots`, one 1-row SDPA call each)."""
    target, _ = tiny_pair
    model = load_model(target, "float32").model
    attn = model.layers[0].attn
    rows, region, length = 4, 8, 6
    gen = torch.Generator().manual_seed(7)
    model.allocate_cache(rows * region)
    k_cache, v_cache = model.k_cache[0], model.v_cache[0]
    k_cache.copy_(torch.randn(k_cache.shape, generator=gen))
    v_cache.copy_(torch.randn(v_cache.shape, generator=gen))
    x = torch.randn(rows, model.cfg.hidden_size, generator=gen)  # [R, hidden]
    positions = torch.full((rows,), length - 1)
    cos, sin = model.rotary(positions)
    slots = torch.arange(rows) * region + length - 1  # [R]
    mask = torch.rand(rows, length, generator=gen) < 0.7  # [R, L]
    mask[:, -1] = True
    key_slots = torch.arange(rows)[:, None] * region + torch.arange(length)[None]  # [R, L]
    with torch.inference_mode():
        batched = attn(x, cos, sin, slots, mask, k_cache, v_cache, regions=region)
        attn.rows_apart_upto = rows
        per_row = attn(x, cos, sin, slots, mask, k_cache, v_cache, key_slots)
    torch.testing.assert_close(batched, per_row, atol=1e-5, rtol=1e-5)


def test_gathered_keys_are_for_per_row_passes_only(tiny_pair):
    """Rows with their own gathered keys (`key_slots`: tree nodes) are scored in 1-row calls
    only; a pass of more rows than rows_apart_upto is refused, never batched."""
    target, _ = tiny_pair
    model = load_model(target, "float32").model
    model.allocate_cache(64)
    rows = torch.arange(3)
    key_slots = rows[:, None] * 8 + torch.arange(8)[None]  # [3, 8]
    mask = torch.ones(3, 8, dtype=torch.bool)
    with torch.inference_mode(), pytest.raises(AssertionError, match="per-row attention"):
        model.hidden_states(rows + 1, rows, rows * 8, mask, key_slots)


def test_train_on_self_text_beside_a_corpus_and_from_a_head(tiny_pair, tmp_path):
    """A head trains on corpus sequences (cut to the self-written length) and self-written
    ones together, each source holding out its own; `init` starts from a trained head (at a
    learning rate of ~0 it ends where it started, its vocabulary kept)."""
    target, _ = tiny_pair
    corpus = target_written_text(target, 8, seed=5, temperature=0.0)  # 8 x 64 tokens
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 300, (6,), generator=gen).tolist() for _ in range(20)]
    settings = HeadSettings(96, 256, SETTINGS.train, self_len=32)
    first = tmp_path / "first"
    meta = train_head(
        load_model(target, "float32"), corpus, first, "test", settings, False, prompts
    )
    assert meta["self_tokens"] == 20 * 32 and meta["tokens"] == 8 * 64
    # 16 corpus rows of 32 (1 held out) + 20 self-written (2 held out)
    assert meta["train_sequences"] == 15 + 18
    assert (first / "features-self-32-layers-0-1" / "features-0001.safetensors").exists()
    still = HeadSettings(96, 256, TrainConfig(epochs=1, batch=4, lr=1e-12, warmup=1), 32)
    second = tmp_path / "second"
    meta = train_head(
        load_model(target, "float32"), [], second, "test", still, False, prompts, first
    )
    assert meta["corpus"] == "self" and meta["init"] == str(first)
    before = load_file(str(first / "head.safetensors"))
    after = load_file(str(second / "head.safetensors"))
    assert torch.equal(before["vocab"], after["vocab"])
    for name, weight in before.items():
        torch.testing.assert_close(after[name], weight, atol=1e-6, rtol=0)


def test_self_text_options_are_checked(tiny_pair, tmp_path):
    target, _ = tiny_pair
    common = ["--target", target, "--out", str(tmp_path / "h"), "--no-progress"]
    for options, said in (
        (["--self-tokens", "100"], "--self-tokens must be 0 or at least 512"),
        (["--self-tokens", "4096", "--seq-len", "100"], "multiple of --self-len"),
        (["--tokens", "10"], "--tokens must be at least 1024"),
        (["--init", str(tmp_path / "nothing")], "no trained head there"),
        (["--opener-tokens", "100"], "--opener-tokens must be 0 or at least 512"),
        (["--opener-tokens", "4096", "--self-len", "64"], "--self-len must be over 64"),
        (["--opener-tokens", "-1"], "--opener-tokens must be at least 0"),
        (["--chat-tokens", "100"], "--chat-tokens must be 0 or at least 512"),
        (["--chat-tokens", "-1"], "--chat-tokens must be at least 0"),
    ):
        bad = cli("train-head", *common, *options)
        assert bad.returncode == 2 and said in " ".join(bad.stderr.split()), bad.stderr


def test_train_head_on_self_text_from_the_command_line(tiny_pair, tmp_path):
    """`--tokens 0 --self-tokens N`: the target writes all its training text; then `--init`
    trains further from the head that made."""
    target, _ = tiny_pair
    common = ["--target", target, "--no-progress", "--tokens", "0", "--self-len", "64"]
    small = ["--epochs", "1", "--intermediate-size", "32", "--draft-vocab", "64"]
    first, second = tmp_path / "first", tmp_path / "second"
    made = cli("train-head", *common, "--out", str(first), "--self-tokens", "192", *small)
    assert made.returncode == 0, made.stderr
    said = " ".join(made.stderr.split())
    assert "0 tokens (stdlib) + 192 the target writes" in said
    assert len(list((first / "features-self-64-layers-0-1").glob("*.safetensors"))) == 1
    more = cli("train-head", *common, "--out", str(second), "--self-tokens", "128", "--init",
               str(first), "--epochs", "1")  # fmt: skip
    assert more.returncode == 0, more.stderr
    config = json.loads((second / "config.json").read_text())
    assert config["meta"]["init"] == str(first) and config["meta"]["self_tokens"] == 128


def test_sampled_prompts_then_greedy(tiny_pair):
    """With `sample_to`, a sequence's tokens past its prompt are drawn from the target's
    distribution up to sample_to and greedy after it; the same seed draws the same text."""
    target, _ = tiny_pair
    model = load_model(target, "float32").model
    prompts = [[5, 6], [7], [8, 9, 10]]
    sample_to = [20, 12, 3]  # the last: nothing to sample (3 = its prompt's length)

    def run(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        decoded = decode_in_lockstep(model, prompts, 40, sample_to, 1.0, generator)
        return decoded.tokens, decoded.argmax

    tokens, argmax = run(0)
    for b, until in enumerate(sample_to):
        # greedy from sample_to on: the token at t + 1 is the argmax after t
        assert torch.equal(tokens[b, until:], argmax[b, until - 1 : -1])
    # a random tiny target's distributions are nearly flat: samples are seldom its argmax
    drawn = torch.cat([tokens[0, 2:20] != argmax[0, 1:19], tokens[1, 1:12] != argmax[1, 0:11]])
    assert drawn.float().mean() > 0.8
    again, _ = run(0)
    assert torch.equal(again, tokens) and not torch.equal(run(1)[0], tokens)
    greedy = decode_in_lockstep(model, prompts[2:], 40).tokens
    assert torch.equal(tokens[2], greedy[0])


def test_sampled_tokens_follow_the_targets_distribution(tiny_pair):
    """The first sampled token of 3000 copies of one prompt, against softmax(logits / T):
    chi-squared over the target's 12 likeliest tokens and the rest pooled, p > 1e-4 (a
    correct sampler fails this 1 time in 10^4). Mutation: sampling at temperature 1 while
    asked for 0.5 fails it."""
    from scipy.stats import chisquare

    target, _ = tiny_pair
    model = load_model(target, "float32").model
    prompt, copies, temperature = [11, 12, 13], 3000, 0.5
    with torch.inference_mode():
        hidden, _ = target_features(model, torch.tensor(prompt))
        probs = torch.softmax(model.lm_head(hidden[-1:]).float() / temperature, -1)[0]
    top = probs.topk(12).indices
    share = torch.cat([probs[top], (1 - probs[top].sum()).reshape(1)]).double()
    expected = share / share.sum() * copies

    def counts(sample_temperature: float) -> torch.Tensor:
        generator = torch.Generator().manual_seed(7)
        tokens = decode_in_lockstep(
            model, [prompt] * copies, 5, [5] * copies, sample_temperature, generator
        ).tokens
        first = tokens[:, 3]  # [copies]
        hits = (first[:, None] == top[None]).sum(0).double()  # [12]
        return torch.cat([hits, (copies - hits.sum()).reshape(1)])

    assert chisquare(counts(temperature), expected).pvalue > 1e-4
    assert chisquare(counts(1.0), expected).pvalue < 1e-4  # mutation: the wrong temperature


def test_train_head_on_text_begun_from_openers(tiny_pair, tmp_path):
    """`--opener-tokens N`: the target begins each prompt from a file opener (OPENERS, in
    turn) and writes the rest; the shards hold the openers' ids first, and the source holds
    out its own last sequences."""
    from transformers import AutoTokenizer

    target, _ = tiny_pair
    out = tmp_path / "head"
    made = cli("train-head", "--target", target, "--no-progress", "--tokens", "0", "--self-len",
               "80", "--opener-tokens", "320", "--epochs", "1", "--intermediate-size", "32",
               "--draft-vocab", "64", "--out", str(out))  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert "0 tokens (stdlib) + 320 the target writes" in " ".join(made.stderr.split())
    meta = json.loads((out / "config.json").read_text())["meta"]
    assert meta["opener_sequences"] == 4 and meta["self_sequences"] == 0
    assert meta["train_sequences"] == 3  # 1 of the 4 held out
    shard = load_file(str(out / "features-open-80-layers-0-1" / "features-0000.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(target)
    for row, opener in zip(shard["tokens"], OPENERS, strict=False):
        ids = tokenizer(opener)["input_ids"]
        assert row[: len(ids)].tolist() == ids


def test_train_head_on_chat_answers_from_the_command_line(tiny_pair, tmp_path):
    """`--chat-tokens N`: the target answers chat prompts about standard-library functions;
    its shards begin with those prompts, and the source holds out its own last sequences."""
    from transformers import AutoTokenizer

    from understudy.head.corpus import stdlib_files

    target, _ = tiny_pair
    out = tmp_path / "head"
    made = cli("train-head", "--target", target, "--no-progress", "--tokens", "0", "--self-len",
               "192", "--chat-tokens", "768", "--epochs", "1", "--intermediate-size", "32",
               "--draft-vocab", "64", "--out", str(out))  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert "0 tokens (stdlib) + 768 the target writes" in " ".join(made.stderr.split())
    meta = json.loads((out / "config.json").read_text())["meta"]
    assert meta["chat_sequences"] == 4 and meta["chat_tokens"] == 768
    assert meta["self_sequences"] == meta["opener_sequences"] == 0
    assert meta["train_sequences"] == 3  # 1 of the 4 held out
    shard = load_file(str(out / "features-chat-192-layers-0-1" / "features-0000.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(target)
    for row, prompt in zip(shard["tokens"], chat_prompts(stdlib_files(), tokenizer, 4, 191),
                           strict=True):  # fmt: skip
        assert row[: len(prompt)].tolist() == prompt
