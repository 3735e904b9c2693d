"""The engine: draft -> verify -> accept -> roll back -> stream, and the stats of it all.

Invariant of the decode loop (`_stream`): `tokens` is prompt + generated; the target's KV
cache holds valid entries for tokens[:-1] (the newest token has not been scored yet).
Each round feeds [tokens[-1], x_1..x_K] to the target in one pass, keeps x_1..x_a and the
verifier's own token, and truncates the target's cache back to the tokens it has now seen.
Greedy output is the target's own argmax sequence bit for bit, because every target decode
pass has the same shape (see models/runner.py); sampled output has the target's
distribution (verify.py).

Trees (methods "draft" and "eagle", option tree="on" | "auto"): the drafter proposes a token tree
(understudy.verify.token_tree) instead of a chain (tree="auto": in the rounds where trees have yielded more
tokens per modelled cost than chains over the engine's requests, tree_choice.py); the target
scores all its nodes in one pass (`Runner.tree_pass`), verify_tree.py picks the accepted
root-to-node path, and `Runner.keep_path` compacts that path's KV to the slots after the prefix, leaving the same
invariant as a chain round. Stats: drafted = nodes in the tree, accepted = path length.
Tree output is lossless (sampling: exact law; greedy: the target's argmax at every step).
Each node attends to its path's keys in chain order (unpadded passes: gathered whole, as the
row-invariant kernels need; padded passes: models/split_attention.py), so its logits are
bitwise plain decoding's and stats.exact stays True.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from understudy.config import (
    SamplingParams,
    UnderstudyError,
    is_unicode_text,
    parse_num_speculative_tokens,
)
from understudy.drafters.base import EMPTY, Proposal, Proposer
from understudy.engine.detokenize import IncrementalDetokenizer
from understudy.engine.stats import GenerationStats, StatsRecorder
from understudy.models.loader import LoadedModel
from understudy.models.runner import Runner
from understudy.policy.adaptive_k import AdaptiveK
from understudy.policy.tree_choice import TreeOrChain
from understudy.verify.chain import Verdict, verify_greedy, verify_sampling
from understudy.verify.sampling import make_generator, sample, warp_probs
from understudy.verify.token_tree import TokenTree
from understudy.verify.tree import TreeVerdict, verify_tree_greedy, verify_tree_sampling

Prompt = str | list[int] | list[dict[str, str]]


@dataclass(frozen=True)
class TokenEvent:
    """One emitted token. origin: "accepted" (a kept guess), "corrected" (the target's token at
    the first rejection), "bonus" (the target's extra token after all guesses were kept) or
    "target" (a target token from a pass with nothing drafted: the prefill, plain decoding)."""

    token_id: int
    text: str
    origin: str
    round: int


@dataclass(frozen=True)
class RoundEvent:
    """One verification round, for those who want to see it (the Lab): every drafted token,
    rejected ones included, how many were accepted, and the target's own token."""

    round: int
    drafted: list[int]
    accepted: int
    next_token: int
    origin: str  # of next_token: "corrected", "bonus" or "target" (nothing drafted)
    parents: list[int] | None = None  # a tree round: drafted[i] follows drafted[parents[i]]
    path: list[int] | None = None  # a tree round: the indices into drafted that were kept


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    prompt_token_ids: list[int]


def tree_mode(proposer: Proposer | None) -> str:
    """Whether rounds draft trees: "on" (every round), "auto" (tree_choice.py decides each
    round) or "off": the proposer's `tree` option, where it can draft trees at all."""
    if proposer is None or not hasattr(proposer, "propose_tree"):
        return "off"
    return getattr(proposer, "tree", "off")


class Engine:
    """A target model, an optional proposer, and the loop that makes them lossless."""

    def __init__(
        self,
        target: LoadedModel,
        proposer: Proposer | None,
        method: str,
        num_speculative_tokens: int | str,
        max_context: int,
        verify_rows: int,
        exact: bool = True,
        cost_ratio: float = 0.3,
        pad: bool = True,
    ) -> None:
        self.target = target
        self.tokenizer = target.tokenizer
        self.proposer = proposer
        self.method = method
        self.k = num_speculative_tokens
        self.max_context = max_context
        # pad=False: the target's kernels are row-invariant (kernels/rowgemm.py), so a pass
        # holds only its real rows; else every pass is padded to verify_rows rows
        self.pad = pad
        self.runner = Runner(target.model, max_context, rows=verify_rows, pad=pad)
        # method="eagle": the proposer reads the target's hidden states of kept tokens
        self.observe_hidden = getattr(proposer, "observe_hidden", None)
        self.runner.keep_hidden = self.observe_hidden is not None
        settle_confidence = getattr(proposer, "default_confidence", None)
        if settle_confidence is not None:  # "auto" thresholds (drafters/draft_model.py)
            settle_confidence(num_speculative_tokens == "auto")
        self.tree_mode = tree_mode(proposer)
        # rounds may draft trees (tree="auto": where tree_choice.py finds that they pay)
        self.tree = self.tree_mode in ("on", "auto")
        self.rows_exact = exact  # the row budget is the hardware's default
        self.exact = exact  # trees keep it too (the module docstring)
        self.cost_ratio = cost_ratio  # draft step / target pass, measured by from_pretrained
        self.row_cost = 0.0  # extra target-pass cost per extra row (unpadded passes), measured
        self.tree_node_cost = 0.0  # the same per extra node of a tree pass, measured
        # tree="auto": which shape pays, learnt over this engine's requests (tree_choice.py)
        self.shapes = (
            TreeOrChain(cost_ratio, 0.0, 0.0) if self.tree and self.tree_mode == "auto" else None
        )

    @classmethod
    def from_pretrained(
        cls,
        target: str | None = None,
        draft: str | None = None,
        method: str = "draft",
        num_speculative_tokens: int | str = "auto",
        dtype: str | torch.dtype = "auto",
        max_context: int = 4096,
        verify_rows: int | None = None,
        device: str | None = None,
        draft_quantization: str | None = "auto",
        **drafter_options: object,
    ) -> Engine:
        """Load the models and build a ready engine (DESIGN.md section 3). `drafter_options`
        go to the drafter's `from_models` (e.g. prompt_lookup_max for method="ngram").
        `draft_quantization`: "auto" (int4, group 32, on a CPU; none on CUDA), None, or a
        scheme of models/quant.py ("int8", "int4", "int4-g32", ...), for the draft model or
        method="eagle"'s head. The drafter never decides a token, so quantizing it cannot
        change the output, only the speed."""
        from understudy.engine.builder import build_engine

        return build_engine(
            target=target,
            draft=draft,
            method=method,
            num_speculative_tokens=parse_num_speculative_tokens(num_speculative_tokens),
            dtype=dtype,
            max_context=max_context,
            verify_rows=verify_rows,
            device=device,
            draft_quantization=draft_quantization,
            drafter_options=drafter_options,
        )

    def with_method(self, method: str) -> Engine:
        """The same target (shared weights) with another method; only "none" needs no drafter."""
        if method != "none":
            raise UnderstudyError("with_method builds only the plain baseline; use from_pretrained")
        rows = self.runner.rows
        return Engine(
            self.target, None, "none", 0, self.max_context, rows, self.rows_exact, pad=self.pad
        )

    # -- prompts ---------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """A string, a list of token ids, or a chat message list -> prompt token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise UnderstudyError("the prompt is empty")
            if self.tokenizer is None:
                raise UnderstudyError("this model has no tokenizer: give the prompt as token ids")
            if not is_unicode_text(prompt):
                raise UnderstudyError("the prompt holds a lone surrogate: that is no Unicode text")
            ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self._apply_chat_template(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise UnderstudyError("a prompt is a string, a list of token ids or a list of messages")
        if not ids:
            raise UnderstudyError("the prompt is empty")
        vocab = self.runner.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise UnderstudyError(f"prompt token ids must be in 0..{vocab - 1}")
        if len(ids) >= self.max_context:
            raise UnderstudyError(
                f"the prompt has {len(ids)} tokens; the context holds {self.max_context} "
                "(prompt + generation): shorten it or raise max_context"
            )
        return ids

    def _apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise UnderstudyError("this model has no chat template: give a plain prompt")
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise UnderstudyError("each chat message needs a string 'role' and 'content'")
            if not is_unicode_text(m["role"]) or not is_unicode_text(m["content"]):
                raise UnderstudyError("a chat message holds a lone surrogate: no Unicode text")
        from jinja2 import TemplateError  # transformers renders chat templates with jinja2

        try:
            out = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
        except TemplateError as error:  # many templates raise on a role order they refuse
            raise UnderstudyError(
                f"the model's chat template refused the messages: {error}"
            ) from None
        if hasattr(out, "keys") and "input_ids" in out:
            out = out["input_ids"]
        return list(out)

    # -- generation ------------------------------------------------------------------------

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        on_token: Callable[[TokenEvent], None] | None = None,
    ) -> GenerationOutput:
        """Generate a completion; `on_token` (optional) sees every token as it is emitted."""
        params = params or SamplingParams()
        stream = self.stream(prompt, params)
        for event in stream:
            if on_token is not None:
                on_token(event)
        return stream.output

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        on_round: Callable[[RoundEvent], None] | None = None,
    ) -> TokenStream:
        """An iterator of TokenEvents; its `.output` is the GenerationOutput once exhausted.
        `on_round` (optional) sees each round's drafted tokens before its tokens are emitted."""
        params = params or SamplingParams()
        prompt_ids = self.encode(prompt)
        return TokenStream(self._stream(prompt_ids, params, on_round), prompt_ids)

    def _choose(self, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
        if params.greedy:
            return int(logits.argmax(-1))
        return int(sample(warp_probs(logits[None], params), gen))

    def _verify(
        self, proposal: Proposal, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
    ) -> Verdict:
        if params.greedy:
            return verify_greedy(proposal.draft_ids, logits)
        return verify_sampling(
            proposal.draft_ids, proposal.draft_probs, warp_probs(logits, params), gen
        )

    def _verify_tree(
        self,
        tokens: list[int],
        proposal: Proposal,
        params: SamplingParams,
        gen: torch.Generator,
    ) -> tuple[TreeVerdict, int]:
        """Score a proposed tree in one target pass, verify it, keep the accepted path's KV.
        Returns the verdict and the tree's depth."""
        tree = TokenTree.from_drafts(tokens[-1], proposal.draft_ids, proposal.parents)
        offsets = tree.slot_offsets()  # [N]
        device = self.target.model.device
        logits = self.runner.tree_pass(
            tree.tokens.to(device), tree.depths, offsets, tree.region_mask(offsets)
        ).cpu()  # [N, V]
        if params.greedy:
            verdict = verify_tree_greedy(tree, logits)
        else:
            verdict = verify_tree_sampling(tree, warp_probs(logits, params), gen)
        self.runner.keep_path(offsets[[0, *verdict.path]])  # root + accepted nodes
        if self.observe_hidden is not None:  # the root's and the kept nodes' hidden states
            self.observe_hidden(self.runner.last_hidden[[0, *verdict.path]], len(tokens) - 1)
        return verdict, tree.depth

    def _stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_round: Callable[[RoundEvent], None] | None = None,
    ) -> Iterator[TokenEvent | GenerationOutput]:
        recorder = StatsRecorder(self.method, self.k, self.exact)
        gen = make_generator(params.seed)
        budget = min(params.max_tokens, self.max_context - len(prompt_ids))
        emitter = _Emitter(self, params, budget)
        device = self.target.model.device
        t0 = time.perf_counter()
        span = len(prompt_ids) + budget
        logits = self.runner.prefill(torch.tensor(prompt_ids, device=device), span)  # [V]
        first = self._choose(logits, params, gen)
        recorder.prefill(time.perf_counter() - t0, len(prompt_ids))
        tokens = [*prompt_ids, first]
        yield from emitter.emit([first], "target", 0)
        if self.proposer is not None:
            self.proposer.begin(prompt_ids)
        if self.observe_hidden is not None:
            self.observe_hidden(self.runner.last_hidden, 0)  # the prompt's positions
        # automatic K: a proposer that plans its own round length (hybrid) gets the whole row
        # budget; one whose rounds stop on the draft's own doubt drafts up to the whole budget
        # whenever automatic K says speculation pays (its choice of K is then only 0 or not 0)
        k_max = self.runner.rows - 1
        plans_length = getattr(self.proposer, "plans_length", False)
        stops_itself = getattr(self.proposer, "stops_by_confidence", False)
        shapes = self.shapes
        if shapes is not None:  # the costs as measured at build (factory.measure_engine_costs)
            shapes.c, shapes.v, shapes.v_tree = self.cost_ratio, self.row_cost, self.tree_node_cost
        policy = (
            AdaptiveK(k_max, self.cost_ratio, self.row_cost)
            if self.k == "auto" and not plans_length
            else None
        )
        rounds = 0
        while not emitter.done:
            rounds += 1
            as_tree = self.tree_mode == "on" or (shapes is not None and shapes.choose())
            if policy is None:
                k = k_max if self.k == "auto" else self.k
            else:  # a tree's depth plays K's part; a chain stopping on doubt gets the budget
                k = policy.choose()
                k = k_max if k and stops_itself and not as_tree else k
            k = min(k, emitter.remaining - 1)
            t_draft = time.perf_counter()
            if not self.proposer or k <= 0:
                proposal = EMPTY
            elif as_tree:
                nodes = self.runner.rows - 1
                proposal = self.proposer.propose_tree(tokens, k, nodes, params, gen)
            else:
                proposal = self.proposer.propose(tokens, k, params, gen)
            t_verify = time.perf_counter()
            drafted = proposal.draft_ids.tolist()
            if proposal.parents is None:
                fed = torch.tensor([tokens[-1], *drafted], device=device)
                logits = self.runner.extend(fed).cpu()  # [k'+1, V]
                verdict = self._verify(proposal, logits, params, gen)
                self.runner.truncate(len(tokens) + verdict.accepted)
                if self.observe_hidden is not None:  # tokens[-1] and the kept guesses
                    kept_hidden = self.runner.last_hidden[: verdict.accepted + 1]
                    self.observe_hidden(kept_hidden, len(tokens) - 1)
                accepted, next_token, path = verdict.accepted, verdict.next_token, None
                bonus, depth = accepted == proposal.size, proposal.size
            else:
                tree_verdict, depth = self._verify_tree(tokens, proposal, params, gen)
                accepted, next_token = tree_verdict.accepted, tree_verdict.next_token
                path = [node - 1 for node in tree_verdict.path]  # indices into drafted
                bonus = tree_verdict.bonus
            if policy is not None:
                policy.observe(depth, accepted)  # a tree's depth plays K's part
            if shapes is not None and proposal.size:
                shapes.observe(proposal.parents is not None, accepted + 1, proposal.size, depth)
            recorder.round(
                proposal.size, accepted, t_verify - t_draft, time.perf_counter() - t_verify
            )
            kept = drafted[:accepted] if path is None else [drafted[i] for i in path]
            tokens += [*kept, next_token]
            if proposal.size == 0:
                origin = "target"
            else:
                origin = "bonus" if bonus else "corrected"
            if on_round is not None:
                parents = None if proposal.parents is None else proposal.parents.tolist()
                on_round(RoundEvent(rounds, drafted, accepted, next_token, origin, parents, path))
            yield from emitter.emit(kept, "accepted", rounds)
            yield from emitter.emit([next_token], origin, rounds)
            if self.proposer is not None and not emitter.done:
                self.proposer.commit(tokens)
        end = getattr(self.proposer, "end", None)  # e.g. the suffix drafter's cross-request cache
        if end is not None:
            end(tokens)
        stats = recorder.finish(len(emitter.token_ids), emitter.finish_reason)
        yield GenerationOutput(emitter.text, emitter.token_ids, stats, prompt_ids)


class TokenStream:
    """Iterate to get TokenEvents; afterwards `.output` holds the GenerationOutput."""

    def __init__(
        self, inner: Iterator[TokenEvent | GenerationOutput], prompt_ids: list[int]
    ) -> None:
        self._inner = inner
        self.prompt_ids = prompt_ids
        self.output: GenerationOutput | None = None

    def __iter__(self) -> Iterator[TokenEvent]:
        for item in self._inner:
            if isinstance(item, GenerationOutput):
                self.output = item
            else:
                yield item


class _Emitter:
    """Emits tokens one by one and decides, exactly as plain decoding would, where text ends:
    at an EOS token or one of stop_token_ids (kept in token_ids, not in text), after a stop
    string (cut from the text, or kept with include_stop_str_in_output), at max_tokens or
    at the end of the context."""

    def __init__(self, engine: Engine, params: SamplingParams, budget: int) -> None:
        self.eos = set() if params.ignore_eos else set(engine.target.eos_token_ids)
        self.stop = params.stop
        self.stop_ids = set(params.stop_token_ids)
        self.include_stop = params.include_stop_str_in_output
        self.budget = budget
        self.detok = IncrementalDetokenizer(engine.tokenizer)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason = ""

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    @property
    def remaining(self) -> int:
        return self.budget - len(self.token_ids)

    def emit(self, token_ids: list[int], origin: str, round_index: int) -> Iterator[TokenEvent]:
        for token_id in token_ids:
            if self.done:
                return
            self.token_ids.append(token_id)
            stop_token = token_id in self.stop_ids
            delta = "" if stop_token else self.detok.push(token_id)
            if self.stop and delta:
                delta = self._cut_at_stop(delta)
            self.text += delta
            if token_id in self.eos or stop_token:
                self.finish_reason = "stop"
            elif len(self.token_ids) >= self.budget and not self.done:
                self.finish_reason = "length"
            yield TokenEvent(token_id, delta, origin, round_index)

    def _cut_at_stop(self, delta: str) -> str:
        window_start = max(0, len(self.text) - max(len(s) for s in self.stop))
        window = self.text[window_start:] + delta
        hits = [i for i in (window.find(s) for s in self.stop) if i >= 0]
        if not hits:
            return delta
        self.finish_reason = "stop"
        first = min(hits)
        cut = window_start + first  # index in text + delta where the stop string starts
        if self.include_stop:  # the earliest stop string, first of the list on a tie
            cut += len(next(s for s in self.stop if window.find(s) == first))
        return (
            (self.text + delta)[len(self.text) : cut] if cut >= len(self.text) else self._trim(cut)
        )

    def _trim(self, cut: int) -> str:
        self.text = self.text[:cut]
        return ""
