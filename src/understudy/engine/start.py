"""A request begins: the target scores its prompt in its seat and picks the first token.

After `start_request` the engine loop's invariant holds (engine/engine.py): the request's
tokens are prompt + [first], the seat's target cache holds the prompt, and the seat's
drafter has begun the request (and, where it reads hidden states, seen the prompt's).
"""

from __future__ import annotations

import torch

from understudy.config import SamplingParams
from understudy.constraints import build_processor
from understudy.engine.emitter import Emitter, TokenLogprobs, token_logprobs
from understudy.engine.request import Request, Seat
from understudy.models.loader import LoadedModel
from understudy.verify.sampling import make_generator, sample, warp_probs


def start_request(
    target: LoadedModel, max_context: int, prompt_ids: list[int], params: SamplingParams, seat: Seat
) -> tuple[Request, int, list[TokenLogprobs] | None]:
    """Prefill `prompt_ids` in `seat`; returns the request, its first token and that token's
    logprobs (when asked for)."""
    budget = min(params.max_tokens, max_context - len(prompt_ids))
    emitter = Emitter(target.tokenizer, target.eos_token_ids, params, budget)
    runner = seat.runner
    processor = build_processor(params, target.tokenizer, runner.vocab_size, target.eos_token_ids)
    request = Request(
        list(prompt_ids), params, make_generator(params.seed), emitter, processor, seat
    )
    device = target.model.device
    raw = runner.prefill(torch.tensor(prompt_ids, device=device), len(prompt_ids) + budget)
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
    drafter = seat.drafter
    if drafter is not None:
        drafter.begin(prompt_ids)
        if drafter.traits.wants_hidden:  # the prompt's positions
            assert runner.last_hidden is not None
            drafter.observe_hidden(runner.last_hidden, 0)
    return request, first, token_logprobs(raw[None].cpu(), [first], params.logprobs)
