"""method="draft": a small model of the same family guesses K tokens autoregressively.

The draft keeps its own KV cache. Invariant: its cache holds valid entries for `fed[:length]`,
the tokens it has been fed; after a round `commit` truncates it to the longest prefix that
the real sequence shares, and the next `propose` first feeds the tokens it has not yet seen
(the catch-up: the corrected or bonus token, and the last accepted draft) in one pass.

Stopping a round early, on the draft's own doubt (a doubtful guess is likely rejected, and its
draft step and target row wasted):
- draft_confidence=t: before the first guess after the first whose draft probability is below
  t (cf. transformers' assistant_confidence_threshold);
- draft_path_confidence=t: before the first guess after the first at which the estimated
  chance that the whole round so far is kept falls below t (cf. the stopping rule of
  SpecDec++, Huang et al. 2024). The estimate is the product over the round's guesses of
  the draft's probability of each, calibrated online against what the target kept in this
  request (drafters/calibration.py): it starts as the draft's own product and learns where
  the draft is over- or under-confident.
draft_confidence defaults to 0 (off). draft_path_confidence defaults to "auto": under
num_speculative_tokens="auto" the engine sets AUTO_PATH_CONFIDENCE (0.2), or c + v where a
guess costs more than that (calibration.DoubtRules), and rounds may then run up to the whole
row budget, the draft's doubt ending each one (engine.py); under a fixed K, which the user
chose, it is off (0).

Trees (option tree="on" | "auto", EAGLE-2 style, Li et al. 2024): `propose_tree` grows a
dynamic tree. Each node's score is its cumulative draft probability (the product of the
draft's probabilities along its path); depth by depth, the `branching` best-scoring nodes
of the newest depth are scored in ONE pass of the draft (a tree mask), each gets its
`branching` most likely tokens as children, and finally the `nodes` best-scoring nodes
(a score never exceeds its parent's, so the set is closed under parents) form the tree, in
depth-first order with likelier siblings first (the likeliest path is laid out as a chain).
Drafting costs about `depth` passes, however many nodes. Afterwards the draft's cache is
rolled back to the committed tokens, so the catch-up invariant above is unchanged.
"""

from __future__ import annotations

import torch

from understudy.config import SamplingParams, TreeMode, UnderstudyError
from understudy.drafters.base import (
    EMPTY,
    DraftRequest,
    Proposal,
    Traits,
    propose_one,
    register,
)
from understudy.drafters.calibration import DoubtRules, RoundRecord, chain_and_tree_options
from understudy.drafters.draft_vocab import restrict_draft_vocab, vocab_rows
from understudy.drafters.tree_search import BestFirstTree, tree_log_scores
from understudy.models.hf_fallback import FallbackLM
from understudy.models.loader import LoadedModel
from understudy.models.runner import Runner
from understudy.models.shared_pass import score_together
from understudy.verify.sampling import sample, warp_probs

# draft_path_confidence under automatic K. A guess is worth drafting while the chance that it
# is kept (the round's calibrated path probability) beats what its draft step and target row
# cost in tokens, ~(c + v) * tokens per pass, less the verify pass a longer round saves; 0.2
# was the best fixed floor over the prompt categories (docs/design.md, automatic K)
AUTO_PATH_CONFIDENCE = 0.2


@register("draft")
class DraftModelProposer(DoubtRules):
    traits = Traits(needs_draft_model=True)
    auto_path_confidence = AUTO_PATH_CONFIDENCE

    @classmethod
    def from_models(
        cls, target: LoadedModel, draft: LoadedModel | None, max_context: int, **options: object
    ) -> DraftModelProposer:
        assert draft is not None
        defaults = {
            "tree": "off",
            "tree_branching": 2,
            "draft_confidence": 0.0,
            "draft_path_confidence": "auto",
            "draft_vocab": "auto",
        }
        opts, tree, branching, confidence, path = chain_and_tree_options("draft", options, defaults)
        restrict_draft_vocab(draft, opts["draft_vocab"])  # drafters/draft_vocab.py
        runner = Runner(draft.model, max_context)
        return cls(runner, tree, branching, confidence, path)

    def __init__(
        self,
        runner: Runner,
        tree: TreeMode = "off",
        branching: int = 2,
        confidence: float | None = 0.0,
        path_confidence: float | None = 0.0,
    ) -> None:
        self.runner = runner
        if isinstance(runner.model, FallbackLM):  # transformers' own code: one sequence
            self.traits = Traits(needs_draft_model=True, batches=False)
        self.fed: list[int] = []  # tokens whose KV the draft computed, in order
        # the draft's logits past this many first ids are -inf (drafters/draft_vocab.py): a
        # greedy guess and its probability read the first ids only, a fraction of the time
        # an argmax and softmax over the whole vocabulary take
        self.vocab_rows = vocab_rows(runner.model)
        self.tree = tree  # "off", "on" or "auto" (the engine decides each round: tree_choice.py)
        self.branching = branching
        self.init_doubt(confidence, path_confidence)

    def draft_runner(self) -> Runner:
        return self.runner

    def begin(self, prompt_ids: list[int]) -> None:
        self.fed = []
        self.runner.truncate(0)
        self.record = RoundRecord()

    def for_seat(self, index: int) -> DraftModelProposer:
        if not self.traits.batches:
            raise UnderstudyError(
                "the draft model runs on transformers' own code (its architecture has no fast "
                "path), which holds one sequence: use max_num_seqs=1"
            )
        runner = self.runner
        seat = Runner(runner.model, runner.max_context, first_slot=index * runner.slots)
        drafter = DraftModelProposer(seat, self.tree, self.branching)
        drafter.settled_like(self)
        return drafter

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator
    ) -> Proposal:
        return self.propose_batch([DraftRequest(self, tokens, k, params, generator)])[0]

    @classmethod
    def propose_batch(cls, requests: list[DraftRequest]) -> list[Proposal]:
        """Every sequence's chain, each draft step of all of them in shared passes of the
        draft model (models/shared_pass.py); trees one by one. A sampled sequence steps in
        passes of its own: its draft probabilities enter the acceptance test, and the draft's
        kernels need not be row-invariant, so they are computed exactly as its solo run
        computes them. One request alone is exactly `propose`."""
        out: list[Proposal | None] = [None] * len(requests)
        chains: list[tuple[int, DraftChain]] = []
        for i, r in enumerate(requests):
            if r.tree or r.k <= 0:
                out[i] = propose_one(r)
            else:
                assert isinstance(r.drafter, DraftModelProposer), "a batch of draft models"
                chains.append((i, DraftChain(r.drafter, r.tokens, r.k, r.params, r.generator)))
        active = [chain for _, chain in chains]
        fed = [chain.drafter.unseen(chain.tokens) for chain in active]
        logits = together([c.drafter.runner for c in active], fed, [c.greedy for c in active])
        for chain in active:
            chain.drafter.fed = chain.tokens[: chain.drafter.runner.length]
        while active:
            next_tokens = [chain.take(row) for chain, row in zip(active, logits, strict=True)]
            active = [c for c, t in zip(active, next_tokens, strict=True) if t is not None]
            fed = [t for t in next_tokens if t is not None]
            for chain, token in zip(active, fed, strict=True):
                chain.drafter.fed.append(int(token))
            logits = together([c.drafter.runner for c in active], fed, [c.greedy for c in active])
        for i, chain in chains:
            out[i] = chain.proposal()
        return [p if p is not None else EMPTY for p in out]

    def unseen(self, tokens: list[int]) -> torch.Tensor:
        """Roll the draft back to what `tokens` still shares with it, then the tokens it has
        not seen ([n] >= 1). At least tokens[-1] is fed again: a round's last token may equal
        a guess the draft fed already (a verifier that resamples a rejected guess from p may
        redraw it), and the draft then holds that token's keys but not its logits."""
        self.runner.truncate(min(self.runner.length, len(tokens) - 1))
        return torch.tensor(tokens[self.runner.length :])

    @staticmethod
    def _own_probability(
        logits: torch.Tensor, q: torch.Tensor | None, token: torch.Tensor
    ) -> float:
        """The draft's own probability of its guess (q[token]; greedy: the plain softmax).
        The stopping rules look only at the draft's side, so a round's length is a stopping
        time of the draft's draws and verification stays exact."""
        probs = q if q is not None else torch.softmax(logits.float(), dim=-1)  # [1, V]
        return float(probs[0, token[0]])

    def catch_up(self, tokens: list[int]) -> None:
        """Feed the draft every token of `tokens` it has not seen but the last, which the
        next `propose(tokens, ...)` feeds with its logits: method="hybrid" prices this
        catch-up apart from the guesses, so it times the two apart."""
        self.runner.truncate(min(self.runner.length, len(tokens) - 1))
        unseen = tokens[self.runner.length : -1]
        if unseen:
            self.runner.extend(torch.tensor(unseen, device=self.runner.model.device), True)
        self.fed = tokens[: self.runner.length]

    def _catch_up(self, tokens: list[int]) -> torch.Tensor:
        """Feed the tokens the draft has not seen; return its logits after tokens[-1] [1, V]."""
        fed = self.unseen(tokens).to(self.runner.model.device)
        logits = self.runner.extend(fed, True)
        self.fed = tokens[: self.runner.length]
        return logits

    @torch.inference_mode()
    def propose_tree(
        self,
        tokens: list[int],
        depth: int,
        nodes: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Proposal:
        """A dynamic tree of at most `nodes` drafted tokens and `depth` levels (module
        docstring). Returns a Proposal with `parents` and draft_probs None (the children of
        a node are its top-b draft tokens: deterministic, verified one by one)."""
        if depth < 1 or nodes < 1:
            return EMPTY
        runner = self.runner
        device = runner.model.device
        root_logits = self._catch_up(tokens)  # [1, V]
        base = runner.length - 1  # the root (tokens[-1]) sits at this slot of the draft's cache
        tree = BestFirstTree(nodes, self.branching)
        tree.grow([-1], tree_log_scores(root_logits, params), None)
        for d in range(1, depth):
            expand = tree.expansion()
            if not expand:
                break
            offsets, visible = tree.visibility(expand)
            logits = runner.tree_pass(
                torch.tensor([tree.token[c] for c in expand], device=device),
                torch.full((len(expand),), d, dtype=torch.long),
                offsets,
                visible,
                base=base,
            )  # [e, V]
            tree.grow(expand, tree_log_scores(logits, params), None)
        runner.truncate(len(tokens))  # forget the tree: the draft's cache holds tokens again
        return tree.proposal()

    def commit(self, tokens: list[int]) -> None:
        self.record.judge(tokens)  # how many of the latest round's guesses the target kept
        keep = 0
        limit = min(len(self.fed), len(tokens))
        while keep < limit and self.fed[keep] == tokens[keep]:
            keep += 1
        self.runner.truncate(min(keep, self.runner.length))
        del self.fed[keep:]


class DraftChain:
    """One sequence's chain as it is drafted, guess by guess: `take` draws the next guess
    from the draft's logits after the guesses so far, applying the doubt rules, and says
    whether the draft must be fed that guess to go on."""

    def __init__(
        self,
        drafter: DraftModelProposer,
        tokens: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> None:
        self.drafter, self.tokens, self.k = drafter, tokens, k
        self.params, self.generator = params, generator
        self.greedy = params.greedy
        self.ids: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []
        self.own: list[float] = []
        self.path = 1.0  # the calibrated chance that the guesses so far are all kept

    def take(self, logits: torch.Tensor) -> torch.Tensor | None:
        """logits [1, V]: the draft's after tokens + guesses so far. Returns the guess [1] to
        feed the draft before the next `take`, or None when the chain is complete."""
        drafter, i = self.drafter, len(self.ids)
        q = None if self.greedy else warp_probs(logits, self.params)  # [1, V]
        rows = drafter.vocab_rows
        live = logits if q is not None or rows is None else logits[:, :rows]  # the finite ids
        token = live.argmax(-1) if q is None else sample(q, self.generator)  # [1]
        if drafter.confidence or drafter.path_confidence:
            own = drafter._own_probability(live, q, token)
            self.path *= drafter.calibration.estimate(own)
            doubt, path_doubt = drafter.confidence or 0.0, drafter.path_doubt(i)
            if i > 0 and (own < doubt or self.path < path_doubt):
                return None
            self.own.append(own)
        if q is not None:
            self.probs.append(q[0])
        self.ids.append(token)
        if i == self.k - 1 or drafter.next_guess_doubted(self.path, i + 1):
            return None  # complete (without a draft pass whose guess would be doubted)
        return token

    def proposal(self) -> Proposal:
        if not self.ids:
            return EMPTY
        ids = torch.cat(self.ids).cpu()  # [k']
        self.drafter.record.remember(self.tokens, ids.tolist(), self.own)
        return Proposal(ids, torch.stack(self.probs).cpu() if self.probs else None)


def together(
    runners: list[Runner], tokens: list[torch.Tensor], greedy: list[bool]
) -> list[torch.Tensor]:
    """The last row's logits [1, V] of each runner after feeding it tokens[i]: the greedy
    sequences' rows in one shared pass, each sampled sequence's in a pass of its own."""
    out: list[torch.Tensor | None] = [None] * len(runners)
    shared = [i for i, g in enumerate(greedy) if g]
    if shared:
        logits = score_together([runners[i] for i in shared], [tokens[i] for i in shared], True)
        for i, row in zip(shared, logits, strict=True):
            out[i] = row
    for i, g in enumerate(greedy):
        if not g:
            out[i] = runners[i].extend(tokens[i].to(runners[i].model.device), True)
    return [row for row in out if row is not None]
