"""The engine: draft -> verify -> keep -> emit, one round at a time, and the stats of it all.

Invariant of the decode loop: `request.tokens` is prompt + generated; the target's KV cache
holds valid entries for tokens[:-1] (the newest token has not been scored yet). A chain round
feeds [tokens[-1], x_1..x_K] to the target in one pass, keeps x_1..x_a and the verifier's own
token, and truncates the target's cache back to the tokens it has now seen. Greedy output is
the target's own argmax sequence bit for bit, because a row's logits do not depend on the
other rows of its pass (models/runner.py); sampled output has the target's distribution
(verify/chain.py). A logits processor (penalties, a grammar: understudy.constraints) is
applied to every verified row as plain decoding would apply it at that position, so both
statements hold for the processed distribution.

A tree round (draft and eagle, tree="on" | "auto") scores a token tree in one pass
(`Runner.tree_pass`), each node over its path's keys in chain order, so bitwise plain
decoding's; verify/tree.py picks the kept path and `Runner.keep_path` compacts its KV to the
chain's slots, leaving the same invariant. Stats: drafted = nodes, accepted = path length.
Requests with a logits processor draft chains only; so do batched rounds (engine/batch.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, overload

import torch

from understudy.config import SamplingParams, UnderstudyError, parse_num_speculative_tokens
from understudy.constraints import build_processor
from understudy.drafters.base import EMPTY, Drafter, Proposal
from understudy.engine.batch import BatchLoop, generate_batch, stream_batch
from understudy.engine.emitter import Emitter, TokenEvent, token_logprobs
from understudy.engine.outputs import GenerationOutput, RoundEvent, TokenStream
from understudy.engine.prompts import Prompt, encode_prompt, is_batch
from understudy.engine.request import Request, Seat, Verified
from understudy.engine.seats import make_seats
from understudy.engine.stats import StatsRecorder
from understudy.models.loader import LoadedModel
from understudy.models.runner import Runner
from understudy.policy.batch_plan import BatchCosts
from understudy.policy.costs import Costs
from understudy.policy.planner import Plan, RoundPlanner
from understudy.policy.tree_choice import TreeOrChain
from understudy.verify.chain import verify_greedy, verify_sampling
from understudy.verify.sampling import make_generator, sample, warp_probs
from understudy.verify.token_tree import TokenTree
from understudy.verify.tree import verify_tree_greedy, verify_tree_sampling

if TYPE_CHECKING:
    from understudy.engine.builder import EngineParts


class Engine:
    """A target model, an optional drafter, and the loop that makes them lossless."""

    def __init__(
        self,
        target: LoadedModel,
        runner: Runner,
        drafter: Drafter | None,
        method: str,
        num_speculative_tokens: int | str,
        max_context: int,
        exact: bool = True,
        costs: Costs | None = None,
        seats: list[Seat] | None = None,
        batch_costs: BatchCosts | None = None,
    ) -> None:
        self.target = target
        self.tokenizer = target.tokenizer
        self.runner = runner
        self.drafter = drafter
        self.method = method
        self.k = num_speculative_tokens
        self.max_context = max_context
        self.exact = exact
        self.costs = costs or Costs()
        self.runner.keep_hidden = drafter is not None and drafter.wants_hidden
        self.seat = Seat(runner, drafter)
        # many sequences at once (engine/batch.py): seat 0 is this engine's own
        self.batch = BatchLoop(self, seats or [self.seat], batch_costs)
        for seat in seats or [Seat(runner, drafter)]:  # every seat's drafter, the same way
            if seat.drafter is not None:
                seat.drafter.settle_confidence(num_speculative_tokens == "auto")
        self.tree_mode = "off" if drafter is None else drafter.tree
        # tree="auto": which shape pays, learnt over this engine's requests (tree_choice.py)
        self.shapes = (
            TreeOrChain(self.costs.draft_step, self.costs.row, self.costs.tree_node)
            if self.tree_mode == "auto"
            else None
        )

    @property
    def tree(self) -> bool:
        """Whether rounds may draft trees (tree="on", or "auto" where they pay)."""
        return self.tree_mode in ("on", "auto")

    @property
    def pad(self) -> bool:
        """Whether every target pass is padded to the runner's row budget (else the target's
        kernels are row-invariant and a pass holds only its real rows)."""
        return self.runner.pad

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
        quantization: str = "auto",
        max_num_seqs: int | str = 1,
        **drafter_options: object,
    ) -> Engine:
        """Load the models and build a ready engine (engine/builder.py). `drafter_options`
        go to the drafter's `from_models` (e.g. prompt_lookup_max for method="ngram").
        `draft_quantization`: "auto", None, a scheme of models/quant.py or "q4_0" for a GGUF
        draft (builder.resolve_draft_quantization); none of them can change the output.
        `quantization`: "auto" (a GGUF runs from its own blocks on a CPU), "gguf" or "none"
        (dense, in `dtype`). `max_num_seqs`: sequences decoded together (engine/batch.py)."""
        from understudy.engine.builder import EngineSpec, assemble, load_models

        spec = EngineSpec(
            method=method,
            k=parse_num_speculative_tokens(num_speculative_tokens),
            max_context=max_context,
            verify_rows=verify_rows,
            draft_quantization=draft_quantization,
            drafter_options=dict(drafter_options),
            max_num_seqs=max_num_seqs,
        )
        models = load_models(target, draft, spec, dtype, device, quantization)
        return cls.from_parts(assemble(models, spec, draft))

    @classmethod
    def from_parts(cls, parts: EngineParts) -> Engine:
        """An engine from what engine/builder.py assembled."""
        p = parts
        return cls(p.target, p.runner, p.drafter, p.method, p.num_speculative_tokens,
                   p.max_context, p.exact, p.costs, p.seats, p.batch_costs)  # fmt: skip

    def with_method(self, method: str) -> Engine:
        """The same target (shared weights and cache) with no drafter: the plain baseline."""
        if method != "none":
            raise UnderstudyError("with_method builds only the plain baseline; use from_pretrained")
        runner = Runner(
            self.target.model, self.max_context, rows=self.runner.rows, pad=self.runner.pad
        )  # its own: the drafting engine's runner keeps hidden states, this one does not
        seats = make_seats(runner, None, len(self.batch.seats))  # the same regions, in turn
        return Engine(self.target, runner, None, "none", 0, self.max_context, self.exact,
                      seats=seats)  # fmt: skip

    def encode(self, prompt: Prompt) -> list[int]:
        """A string, a list of token ids, or a chat message list -> prompt token ids."""
        return encode_prompt(prompt, self.tokenizer, self.runner.vocab_size, self.max_context)

    # -- generation ------------------------------------------------------------------------

    @overload
    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        on_token: Callable[[TokenEvent], None] | None = None,
    ) -> GenerationOutput: ...

    @overload
    def generate(
        self,
        prompt: list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        on_token: None = None,
    ) -> list[GenerationOutput]: ...

    def generate(self, prompt, params=None, on_token=None):
        """Generate a completion; `on_token` (optional) sees every token as it is emitted.
        A list of prompts (with one SamplingParams for all, or one each) runs as a batch on
        the engine's seats (max_num_seqs) and returns the outputs in order, each exactly
        what its prompt gives alone."""
        if is_batch(prompt):
            if on_token is not None:
                raise UnderstudyError("on_token streams one prompt; a batch returns outputs")
            return generate_batch(self.batch, [self.encode(p) for p in prompt], params)
        stream = self.stream(prompt, params or SamplingParams())
        for event in stream:
            if on_token is not None:
                on_token(event)
        assert stream.output is not None
        return stream.output

    def stream_batch(
        self,
        prompts: list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> Iterator[tuple[int, TokenEvent | GenerationOutput]]:
        """(i, TokenEvent) for prompt i as its tokens come, then (i, its GenerationOutput)."""
        return stream_batch(self.batch, [self.encode(p) for p in prompts], params)

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

    def _stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_round: Callable[[RoundEvent], None] | None,
    ) -> Iterator[TokenEvent | GenerationOutput]:
        recorder = StatsRecorder(self.method, self.k, self.exact)
        t0 = time.perf_counter()
        request, first = self._prefill(prompt_ids, params, self.seat)
        recorder.prefill(time.perf_counter() - t0, len(prompt_ids))
        yield from request.emitter.emit([first[0]], "target", 0, first[1])
        planner = self._planner(request)
        rounds = 0
        while not request.emitter.done:
            rounds += 1
            plan = planner.plan(request.emitter.remaining)
            t_draft = time.perf_counter()
            proposal = self._propose(request, plan)
            t_verify = time.perf_counter()
            verified = self._verify(request, proposal)
            planner.observe(
                proposal.parents is not None, proposal.size, len(verified.kept), verified.depth
            )
            recorder.round(
                proposal.size,
                len(verified.kept),
                t_verify - t_draft,
                time.perf_counter() - t_verify,
            )
            yield from self._emit(request, verified, rounds, on_round)
        if request.seat.drafter is not None:
            request.seat.drafter.end(request.tokens)
        emitter = request.emitter
        stats = recorder.finish(len(emitter.token_ids), emitter.finish_reason)
        yield GenerationOutput(emitter.text, emitter.token_ids, stats, prompt_ids)

    def _prefill(
        self, prompt_ids: list[int], params: SamplingParams, seat: Seat
    ) -> tuple[Request, tuple[int, list | None]]:
        """Score the prompt, choose the first token, start the drafter: the loop's invariant
        holds from here on."""
        budget = min(params.max_tokens, self.max_context - len(prompt_ids))
        emitter = Emitter(self.tokenizer, self.target.eos_token_ids, params, budget)
        processor = build_processor(
            params, self.tokenizer, self.runner.vocab_size, self.target.eos_token_ids
        )
        generator = make_generator(params.seed)
        request = Request(list(prompt_ids), params, generator, emitter, processor, seat)
        device = self.target.model.device
        raw = seat.runner.prefill(torch.tensor(prompt_ids, device=device), len(prompt_ids) + budget)
        logits = raw[None].cpu()  # [1, V]
        if processor is not None:
            processor.begin(prompt_ids)
            logits = processor.process(logits, [])
        if params.greedy:
            first = int(logits[0].argmax(-1))
        else:
            first = int(sample(warp_probs(logits, params), request.generator))
        request.tokens.append(first)
        if processor is not None:
            processor.commit(request.tokens)
        if seat.drafter is not None:
            seat.drafter.begin(prompt_ids)
            if seat.drafter.wants_hidden:  # the prompt's positions
                seat.drafter.observe_hidden(seat.runner.last_hidden, 0)
        logprobs = token_logprobs(raw[None].cpu(), [first], params.logprobs)
        return request, (first, logprobs)

    def _planner(self, request: Request, trees: bool = True) -> RoundPlanner:
        """The request's round planner; trees=False (a batch's rounds) plans chains only."""
        drafter = self.drafter
        chains = request.processor is not None or not trees
        return RoundPlanner(
            self.k,
            self.runner.rows or 1,
            "off" if chains else self.tree_mode,
            self.costs,
            drafter is not None and drafter.plans_length,
            drafter is not None and drafter.stops_by_confidence,
            None if chains else self.shapes,
        )

    def _propose(self, request: Request, plan: Plan) -> Proposal:
        drafter = request.seat.drafter
        if drafter is None or plan.k <= 0:
            return EMPTY
        args = (request.params, request.generator)
        if plan.tree:
            return drafter.propose_tree(request.tokens, plan.k, plan.nodes, *args)
        return drafter.propose(request.tokens, plan.k, *args)

    def _verify(self, request: Request, proposal: Proposal) -> Verified:
        if proposal.parents is not None:
            return self._verify_tree(request, proposal)
        return self._verify_chain(request, proposal)

    def _verify_chain(self, request: Request, proposal: Proposal) -> Verified:
        """One target pass over [tokens[-1], x_1..x_K]; keep the longest agreed prefix."""
        raw = request.seat.runner.extend(self.chain_rows(request, proposal)).cpu()  # [K+1, V]
        return self.judge_chain(request, proposal, raw)

    def chain_rows(self, request: Request, proposal: Proposal) -> torch.Tensor:
        """What a chain round feeds the target: [tokens[-1], x_1..x_K] ([K+1])."""
        drafted = proposal.draft_ids.tolist()
        return torch.tensor([request.tokens[-1], *drafted], device=self.target.model.device)

    def judge_chain(self, request: Request, proposal: Proposal, raw: torch.Tensor) -> Verified:
        """Verify a chain against the target's rows raw [K+1, V] of its pass; roll the cache
        back to the tokens kept."""
        tokens, params, runner = request.tokens, request.params, request.seat.runner
        drafter = request.seat.drafter
        drafted = proposal.draft_ids.tolist()
        logits = raw if request.processor is None else request.processor.process(raw, drafted)
        if params.greedy:
            verdict = verify_greedy(proposal.draft_ids, logits)
        else:
            probs = warp_probs(logits, params)  # [K+1, V]
            verdict = verify_sampling(
                proposal.draft_ids, proposal.draft_probs, probs, request.generator
            )
        a = verdict.accepted
        runner.truncate(len(tokens) + a)
        if runner.keep_hidden and drafter is not None:  # tokens[-1], kept guesses
            drafter.observe_hidden(runner.last_hidden[: a + 1], len(tokens) - 1)
        bonus = a == proposal.size
        return Verified(
            proposal, drafted[:a], verdict.next_token, bonus, proposal.size, raw[: a + 1]
        )

    def _verify_tree(self, request: Request, proposal: Proposal) -> Verified:
        """Score a proposed tree in one target pass, verify it, keep the accepted path's KV."""
        tokens, params = request.tokens, request.params
        tree = TokenTree.from_drafts(tokens[-1], proposal.draft_ids, proposal.parents)
        offsets = tree.slot_offsets()  # [N]
        device = self.target.model.device
        runner, drafter = request.seat.runner, request.seat.drafter
        raw = runner.tree_pass(
            tree.tokens.to(device), tree.depths, offsets, tree.region_mask(offsets)
        ).cpu()  # [N, V]
        if params.greedy:
            verdict = verify_tree_greedy(tree, raw)
        else:
            verdict = verify_tree_sampling(tree, warp_probs(raw, params), request.generator)
        nodes = [0, *verdict.path]  # the root and the accepted nodes
        runner.keep_path(offsets[nodes])
        if runner.keep_hidden and drafter is not None:
            drafter.observe_hidden(runner.last_hidden[nodes], len(tokens) - 1)
        path = [node - 1 for node in verdict.path]  # indices into drafted
        drafted = proposal.draft_ids.tolist()
        kept = [drafted[i] for i in path]
        return Verified(
            proposal, kept, verdict.next_token, verdict.bonus, tree.depth, raw[nodes], path
        )

    def _emit(
        self,
        request: Request,
        verified: Verified,
        round_index: int,
        on_round: Callable[[RoundEvent], None] | None,
    ) -> Iterator[TokenEvent]:
        """Append the round's tokens, show the round, emit its tokens, tell the drafter."""
        proposal, kept, next_token = verified.proposal, verified.kept, verified.next_token
        request.tokens += [*kept, next_token]
        if proposal.size == 0:
            origin = "target"
        else:
            origin = "bonus" if verified.bonus else "corrected"
        if on_round is not None:
            drafted = proposal.draft_ids.tolist()
            parents = None if proposal.parents is None else proposal.parents.tolist()
            on_round(
                RoundEvent(
                    round_index, drafted, len(kept), next_token, origin, parents, verified.path
                )
            )
        logprobs = token_logprobs(verified.raw_logits, [*kept, next_token], request.params.logprobs)
        emitter = request.emitter
        yield from emitter.emit(kept, "accepted", round_index, logprobs and logprobs[:-1])
        yield from emitter.emit([next_token], origin, round_index, logprobs and logprobs[-1:])
        if request.processor is not None:
            request.processor.commit(request.tokens)
        if request.seat.drafter is not None and not emitter.done:
            request.seat.drafter.commit(request.tokens)
