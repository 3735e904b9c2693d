"""method="eagle": the target's own trained head guesses K tokens from its hidden states.

The engine hands this proposer the target's final hidden state of every token the target
has scored and kept (`observe_hidden`, after the prefill and after each verification), so
the proposer knows f_p for positions p = 0..len(tokens)-2 (the newest token is not scored
yet). Invariant: the head's cache holds pairs (f_p, token p+1) with REAL features for
positions 0..head.length-1, and head.length <= len(tokens) - 1.

A round: feed the pairs the head has not seen (catch-up, one pass), take its prediction for
the token after tokens[-1], then feed (its own predicted feature, its own guess) K-1 times;
finally roll the head back to the real pairs, since the guesses' real features arrive from
the target only if they are accepted.

Stopping a chain round on the head's own doubt (draft_confidence, draft_path_confidence: the
options and the calibration of method="draft", drafters/draft_model.py): under automatic K
draft_path_confidence="auto" is AUTO_PATH_CONFIDENCE, and a round then drafts until the
calibrated chance of keeping it all falls below that, up to the row budget.

The draft vocabulary is the head's N most frequent target tokens: q is zero elsewhere,
which rejection sampling handles like any other q (verify.py), so sampling stays exact.

Trees (option tree="on" | "auto", as method="draft"; EAGLE-2): `propose_tree` grows a tree
best-first (drafters/tree_search.py). Depth by depth the chosen nodes are fed to the head
in ONE step as pairs (their parent's predicted feature, their token), each attending to
the real pairs and its own ancestors (`EagleHead.tree_step`); their predictions score
their children. The nodes' pairs sit past the head's real pairs and are forgotten after
the round, so the invariant above holds.

Free guesses first (option free_drafts, default "ngram"; drafters/free_first.py): where the
text already holds what follows, a round drafts it by lookup, at no draft cost, instead of
the head's guesses. The head learns those tokens' real features after verification like any
kept token's (the catch-up above), so the invariant holds across such rounds too.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path

import torch

from understudy.cache import cache_dir
from understudy.config import SamplingParams, TreeMode, UnderstudyError
from understudy.drafters.base import EMPTY, Proposal, Traits, register
from understudy.drafters.calibration import DoubtRules, RoundRecord, chain_and_tree_options
from understudy.drafters.free_first import FreeFirst, free_drafter
from understudy.drafters.tree_search import BestFirstTree, tree_log_scores
from understudy.models.block_linears import BLOCK_SCHEMES, block_linears
from understudy.models.eagle_head import CONFIG_FILE, EagleHead, read_head_config
from understudy.models.head_file import file_sha256, load_any_head, read_packed, shipped_head
from understudy.models.loader import LoadedModel
from understudy.models.quant import quantize_model
from understudy.models.transformer import Transformer
from understudy.policy.costs import Costs
from understudy.verify.sampling import sample, warp_probs

# head cache slots past the real pairs, for a tree's nodes (a round stops growing its tree
# before they run out)
TREE_SLOTS = 256
# draft_path_confidence under automatic K: a guess is worth drafting while the chance that
# the round is kept up to it beats its cost in tokens, ~(c + v) * tokens per pass, with c a
# few hundredths for the head: 0.05 (docs/eagle.md)
AUTO_PATH_CONFIDENCE = 0.05


def target_key(name: str) -> str:
    """A folder name for a target spec ("qwen2.5-coder-1.5b", "Qwen/X", "/a/b.gguf")."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name.strip("/")) or "target"


def default_head_dir(target_name: str) -> Path:
    """Where `understudy train-head` writes the head of `target_name` without --out."""
    return cache_dir() / "heads" / target_key(target_name)


def find_head(target: LoadedModel, head: str | None) -> Path:
    """The head to use, a trained head's folder or a packed head's file: `head` if given;
    else the one `understudy train-head` wrote to the cache for this target (the user's own
    training wins); else the package's own (models/head_file.py), where it was trained on
    this very target file."""
    train = f"understudy train-head --target {target.name}"
    if head:
        path = Path(head).expanduser()
        if path.is_file():
            check_packed_head(path, target, train)
            return path
        if not (path / CONFIG_FILE).exists():
            raise UnderstudyError(f"{path} holds no trained head (train one: {train} --out {path})")
        return check_head_folder(path, target)
    folder = default_head_dir(target.name)
    if (folder / CONFIG_FILE).exists():
        return check_head_folder(folder, target)
    shipped = shipped_head()
    if shipped.is_file():
        check_packed_head(shipped, target, train)
        return shipped
    raise UnderstudyError(
        f"no trained head for target {target.name!r} yet: train one with `{train}` "
        "(about an hour on a 2-core CPU), or pass draft=DIR"
    )


def check_head_folder(folder: Path, target: LoadedModel) -> Path:
    """`folder`, once its head's sizes fit the target's."""
    cfg, _ = read_head_config(folder)
    # eagle reads the target's hidden states: a FallbackLM target, which has none to read,
    # is refused first (hf_fallback.refuse_on_fallback, by the builder and the inspection)
    assert isinstance(target.model, Transformer)
    t = target.model.cfg
    if (cfg.hidden_size, cfg.target_vocab_size) != (t.hidden_size, t.vocab_size):
        raise UnderstudyError(
            f"the head in {folder} was trained for another target "
            f"(hidden {cfg.hidden_size}, vocabulary {cfg.target_vocab_size})"
        )
    return folder


def check_packed_head(path: Path, target: LoadedModel, train: str) -> None:
    """Refuse a packed head unless it was trained on the target's own file (by sha256)."""
    _, sha256, meta = read_packed(path)
    if file_sha256(target.name) != sha256:
        raise UnderstudyError(
            f"the head in {path} belongs to another target file ({meta.get('target')!r}, "
            f"sha256 {sha256[:16]}...), not to {target.name!r}: train one for it with "
            f"`{train}` (about an hour on a 2-core CPU), or pass draft=DIR"
        )


@register("eagle")
class EagleProposer(DoubtRules):
    traits = Traits(draft_names_head=True, wants_hidden=True)
    auto_path_confidence = AUTO_PATH_CONFIDENCE

    @classmethod
    def from_models(
        cls, target: LoadedModel, draft: LoadedModel | None, max_context: int, **options: object
    ) -> EagleProposer:
        defaults = {
            "head": None,
            # trees where they pay (tree_choice.py), 4 children a node: trees beat chains
            # where rows are free (padded bf16 passes) and lose where each row costs
            # (unpadded float32), so "auto" learns which; 4 children keep more tokens a tree
            # round than 2, and more than 4 no more (docs/eagle.md)
            "tree": "auto",
            "tree_branching": 4,
            "draft_confidence": 0.0,
            "draft_path_confidence": "auto",
            # a round from the text itself where it pays more than the head's (free_first.py):
            # n-gram lookup: it reads the request's own text alone, and paid as much as the
            # suffix trie, which also reads earlier requests' (docs/eagle.md)
            "free_drafts": "ngram",
        }
        opts, tree, branching, confidence, path = chain_and_tree_options("eagle", options, defaults)
        free = free_drafter(opts["free_drafts"])
        if opts["head"] is not None and not isinstance(opts["head"], str):
            raise UnderstudyError(f"head must be a folder or a file (a path), got {opts['head']!r}")
        found = find_head(target, opts["head"])
        assert isinstance(target.model, Transformer)  # as find_head: refused on a FallbackLM
        head = load_any_head(found, target.model)
        target.model.feature_layers = head.cfg.feature_layers  # what its runner keeps
        free_first = None if free is None else FreeFirst(free)
        return cls(head, max_context, tree, branching, confidence, path, free_first)

    def __init__(
        self,
        head: EagleHead,
        max_context: int,
        tree: TreeMode = "auto",
        branching: int = 4,
        confidence: float | None = 0.0,
        path_confidence: float | None = 0.0,
        free_first: FreeFirst | None = None,
    ) -> None:
        self.head = head
        hidden = head.cfg.hidden_size
        self.features = torch.zeros(max_context + 1, hidden)  # [P, hidden] f_p, real ones
        self.known = 0  # features are valid for positions 0..known-1, once `pending` is in
        # rows the target kept, (start, [n, feature_size]), not yet through the head's input
        # layer: they go through it together when the head next drafts (`real_features`), so
        # a sequence of a batch that drafts nothing for a while streams that layer once
        self.pending: list[tuple[int, torch.Tensor]] = []
        head.allocate_cache(max_context + 1 + TREE_SLOTS)
        self.vocab = head.vocab.cpu()  # [N] draft vocabulary id -> target token id
        self.tree = tree  # "off", "on" or "auto" (the engine decides each round)
        self.branching = branching
        self.init_doubt(confidence, path_confidence)
        self.free_first = free_first  # free guesses where they pay more (free_first.py)

    def settle(self, costs: Costs, automatic_k: bool) -> None:
        super().settle(costs, automatic_k)
        if self.free_first is not None:
            self.free_first.settle(costs)

    def quantize(self, scheme: str) -> None:
        """Quantize the head's linears, its LM rows included (models/quant.py), in place. It
        only drafts, so this changes how often guesses are kept, never the output (int4-g32
        halved a head step on a 2-core CPU and moved held-out agreement by <= 0.004), or in
        GGUF blocks on qgemm (q8_0 / q4_0: models/block_linears.py)."""
        if scheme in BLOCK_SCHEMES:
            block_linears(self.head, scheme)
        else:
            quantize_model(self.head, scheme)

    def begin(self, prompt_ids: list[int]) -> None:
        self.known = 0
        self.pending.clear()
        self.head.truncate(0)
        self.record = RoundRecord()
        if self.free_first is not None:
            self.free_first.begin(prompt_ids)

    def observe_hidden(self, hidden: torch.Tensor, start: int) -> None:
        """What the target's runner kept [n, feature_size] of positions start..start+n-1
        (its final hidden states, or its feature layers' outputs)."""
        self.pending.append((start, hidden.clone()))  # the runner's buffer is reused
        self.known = start + hidden.shape[0]
        self.head.truncate(min(self.head.length, start))  # pairs past start used old features

    @torch.inference_mode()
    def real_features(self) -> torch.Tensor:
        """f_p of positions 0..known-1 [known, hidden]: the pending rows through the head's
        input layer in one call, written in the order they were observed (a later row of a
        position replaces an earlier one)."""
        if self.pending:
            fused = self.head.input_features(torch.cat([h for _, h in self.pending]))
            fused = fused.float().cpu()  # [rows, hidden]
            offset = 0
            for start, rows in self.pending:
                n = rows.shape[0]
                self.features[start : start + n] = fused[offset : offset + n]
                offset += n
            self.pending.clear()
        return self.features[: self.known]

    def _guess(
        self, predicted: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> tuple[int, torch.Tensor | None, float]:
        """One guess from a predicted feature [hidden]: (target token id, q [V] or None, the
        head's own probability of the guess: q's, or greedy, the plain softmax's)."""
        logits = self.head.draft_logits(predicted[None]).float().cpu()  # [1, N]
        if params.greedy:
            index = int(logits.argmax())
            own = float(torch.softmax(logits[0], -1)[index]) if self.stops_by_confidence else 1.0
            return int(self.vocab[index]), None, own
        # Warping the N draft logits equals warping the full vocabulary with -inf elsewhere
        # (those tokens get probability 0 under every warp), at a fraction of the cost.
        q_draft = warp_probs(logits, params)  # [1, N]
        index = int(sample(q_draft, generator))
        q = torch.zeros(self.head.cfg.target_vocab_size)  # [V], the verifier's q
        q[self.vocab] = q_draft[0]
        return int(self.vocab[index]), q, float(q_draft[0, index])

    def _free_guesses(self, tokens: list[int], k: int) -> Proposal | None:
        """The round's free guesses, where they pay more than the head's (None: the head
        drafts). The head sees their real features after verification, as any kept token's."""
        if self.free_first is None:
            return None
        guesses = self.free_first.offer(tokens, k)
        if not guesses:
            return None
        return Proposal(torch.tensor(guesses, dtype=torch.long), None, free=True)  # q one-hot

    @torch.inference_mode()
    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator
    ) -> Proposal:
        free = self._free_guesses(tokens, k)
        if free is not None:
            return free
        head, real = self.head, len(tokens) - 1
        predicted = self._catch_up(tokens)  # [hidden] f^ for the position of tokens[-1]
        ids: list[int] = []
        probs: list[torch.Tensor] = []
        own_probs: list[float] = []
        path = 1.0  # the calibrated chance that the guesses so far are all kept
        for i in range(k):
            token, q, own = self._guess(predicted, params, generator)
            path *= self.record.calibration.estimate(own) if self.stops_by_confidence else 1.0
            if i > 0 and (own < (self.confidence or 0.0) or path < self.path_doubt(i)):
                break  # a function of the head's own draws: verification stays exact
            ids.append(token)
            own_probs.append(own)
            if q is not None:
                probs.append(q)
            if i == k - 1 or self.next_guess_doubted(path, i + 1):
                break  # complete (without a head step whose guess would be doubted)
            predicted = head.extend(torch.tensor([token]), predicted[None])[0]
        head.truncate(real)
        if self.stops_by_confidence:
            self.record.remember(tokens, ids, own_probs)
        if self.free_first is not None:
            self.free_first.head_round(tokens, len(ids), len(ids))
        return Proposal(torch.tensor(ids, dtype=torch.long), torch.stack(probs) if probs else None)

    def _catch_up(self, tokens: list[int]) -> torch.Tensor:
        """Feed the real pairs the head has not seen; return its predicted feature for the
        position of tokens[-1] [hidden] (whose logits guess the token after it)."""
        head, real = self.head, len(tokens) - 1  # pairs with real features: 0..real-1
        assert self.known >= real, (self.known, real)
        features = self.real_features()
        start = head.length
        unseen = torch.tensor(tokens[start + 1 : real + 1])  # tokens of pairs start..real-1
        return head.extend(unseen, features[start:real])[-1]

    @torch.inference_mode()
    def propose_tree(
        self,
        tokens: list[int],
        depth: int,
        nodes: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Proposal:
        """A tree of at most `nodes` guesses and `depth` levels, grown best-first (module
        docstring); draft_probs is None (children are the head's top-b guesses)."""
        if depth < 1 or nodes < 1:
            return EMPTY
        free = self._free_guesses(tokens, depth)
        if free is not None:
            return free  # a chain: the round's pass takes it as one
        head, real = self.head, len(tokens) - 1
        root = self._catch_up(tokens)  # [hidden]
        base = real - 1  # the root's pair (f_{real-1}, tokens[-1]) sits at this slot
        assert head.k_cache is not None  # allocated in __init__ (allocate_cache)
        room = head.k_cache.shape[1] - base
        tree = BestFirstTree(nodes, self.branching)
        tree.grow([-1], tree_log_scores(head.draft_logits(root[None]), params), self.vocab)
        predicted = {-1: root}  # candidate -> the head's prediction after it, once fed
        steps = 1
        for _ in range(1, depth):
            expand = tree.expansion()
            if not expand or tree.fed + len(expand) > room:
                break
            offsets, visible = tree.visibility(expand)
            out = head.tree_step(
                torch.tensor([tree.token[c] for c in expand]),
                torch.stack([predicted[tree.parent[c]] for c in expand]),  # [e, hidden]
                base,
                torch.tensor([tree.level[c] for c in expand]),
                offsets,
                visible,
            )  # [e, hidden]
            predicted.update(zip(expand, out, strict=True))
            tree.grow(expand, tree_log_scores(head.draft_logits(out), params), self.vocab)
            steps += 1
        head.truncate(real)
        proposal = tree.proposal()
        if self.free_first is not None:
            self.free_first.head_round(tokens, proposal.size, steps)
        return proposal

    def commit(self, tokens: list[int]) -> None:
        """Nothing to roll back (`propose` leaves only real pairs in the head's cache); the
        calibration learns how many of the latest chain round's guesses were kept, and free
        drafting what the round yielded."""
        self.record.judge(tokens)
        if self.free_first is not None:
            self.free_first.commit(tokens)

    def for_seat(self, index: int) -> EagleProposer:
        """The same trained head (weights shared) with a KV cache and features of its own."""
        slots = self.features.shape[0] + TREE_SLOTS
        free_first = None if self.free_first is None else self.free_first.for_seat(index)
        drafter = EagleProposer(head_with_own_cache(self.head, slots), self.features.shape[0] - 1,
                                self.tree, self.branching, free_first=free_first)  # fmt: skip
        drafter.settled_like(self)
        return drafter

    def timed_step(self) -> Callable[[], None]:
        """One drafting step: a pair through the head and its LM rows (on a cache of its own,
        so the drafter's is untouched)."""
        head = head_with_own_cache(self.head, 8)
        hidden = torch.zeros(1, head.cfg.hidden_size)
        token = torch.zeros(1, dtype=torch.long)

        @torch.inference_mode()
        def step() -> None:
            head.draft_logits(head.extend(token, hidden))
            head.truncate(0)

        return step


def head_with_own_cache(head: EagleHead, slots: int) -> EagleHead:
    """The same module (its parameters and submodules shared, not copied) with a KV cache of
    `slots` pairs of its own: a seat of a batched engine drafts in its own cache."""
    seat = copy.copy(head)
    seat.k_cache = seat.v_cache = None
    seat.allocate_cache(slots)
    seat.truncate(0)
    return seat
