"""The soak run's requests: a seeded mix of well-formed calls and malformed ones.

Each client draws its requests one by one from its own `random.Random`, seeded by the run's
seed and the client's index, so a run is reproducible request by request (the interleaving
of clients is not). A draw is one of:

- a malformed request (`BadCall`, BAD_SHARE of the draws): raw bytes that must get one
  4xx status whose error names the problem (its `param`, or a word of its message);
- a well-formed `Call` for the official client, /v1/completions or /v1/chat/completions:
  either one of the run's greedy `Scenario`s (GREEDY_SHARE of the calls; temperature 0, so
  its answer is fixed and is compared with the scenario's solo answer), or a sampled call
  (temperature > 0, a seed mostly, top_p, top_k, min_p, penalties, stop strings, a
  constraint, ignore_eos, each drawn). Either way the delivery (whole, streamed, or
  cancelled: the client closes the stream after a few events), n and logprobs are drawn.

A scenario fixes everything that decides a greedy answer (route, prompt, max_tokens, stop,
penalties, constraint); n, logprobs and the delivery do not change the text.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from typing import Any, Literal

from understudy.bench.prompts import BenchPrompt

Route = Literal["completions", "chat"]
Delivery = Literal["whole", "stream", "cancel"]
Constraint = Literal["regex", "json"]

ROUTES: tuple[Route, ...] = ("completions", "chat")
PATHS: dict[Route, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
DELIVERIES: tuple[Delivery, ...] = ("whole", "stream", "cancel")
DELIVERY_WEIGHTS = (0.4, 0.4, 0.2)
BAD_SHARE = 0.15  # of all draws
GREEDY_SHARE = 0.4  # of the well-formed calls
MAX_N = 3  # choices a call asks for; the server's queue is sized for clients * MAX_N
MAX_CANCEL_AFTER = 4  # events a cancelling client reads before it closes the stream
# the greedy scenarios' variants; with 12 scenarios each variant runs on both routes
VARIANTS = ("plain", "stop", "penalties", "repetition", "regex", "json")
SCENARIOS = 12

REGEX = "[0-9]{3}-[a-c]{2}"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "ok", "n"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Call:
    """A well-formed request: `create(**kwargs)` of the openai client's `route` (vLLM's
    extras under kwargs["extra_body"]). `greedy` is its scenario's key (None: sampled)."""

    route: Route
    kwargs: dict[str, Any]
    delivery: Delivery
    cancel_after: int  # events read before closing (delivery "cancel")
    greedy: str | None
    constraint: Constraint | None
    features: tuple[str, ...]  # what it exercises, for the tally

    @property
    def kind(self) -> str:
        return self.route if self.delivery == "whole" else f"{self.route} {self.delivery}"

    @property
    def n(self) -> int:
        return self.kwargs.get("n", 1)

    @property
    def logprobs(self) -> bool:
        asked = self.kwargs.get("logprobs")  # completions: 0..20 alternatives; chat: a bool
        return asked is not None and asked is not False


@dataclass(frozen=True)
class BadCall:
    """A malformed request: `content` sent raw to `route`, which must answer `status` with an
    error whose param or message contains `names`."""

    case: str
    route: Route
    content: bytes
    status: int
    names: str

    @property
    def kind(self) -> str:
        return f"bad: {self.case}"


@dataclass(frozen=True)
class Scenario:
    """A greedy request whose answer the run fixes by sending it alone first."""

    key: str
    route: Route
    kwargs: dict[str, Any]
    constraint: Constraint | None


def prompt_kwargs(prompt: BenchPrompt, route: Route) -> dict[str, Any]:
    """The prompt as `route` takes it: a chat prompt's last message is the completion text; a
    completion prompt is the chat's one user message."""
    if route == "chat":
        if prompt.is_chat:
            return {"messages": prompt.prompt}
        return {"messages": [{"role": "user", "content": prompt.prompt}]}
    return {"prompt": prompt.prompt[-1]["content"] if prompt.is_chat else prompt.prompt}


def constrain(kwargs: dict[str, Any], route: Route, constraint: Constraint) -> None:
    """Add `constraint` to `kwargs`: a regex as vLLM's guided_regex; a JSON schema as OpenAI's
    response_format (a top-level argument of the chat client, an extra for completions)."""
    extra = kwargs.setdefault("extra_body", {})
    if constraint == "regex":
        extra["guided_regex"] = REGEX
        return
    fmt = {"type": "json_schema", "json_schema": {"name": "soak", "schema": SCHEMA}}
    if route == "chat":
        kwargs["response_format"] = fmt
    else:
        extra["response_format"] = fmt


def scenarios(prompts: list[BenchPrompt], model: str, max_tokens: int, seed: int) -> list[Scenario]:
    """SCENARIOS greedy requests: every variant on both routes, prompts in a seeded order."""
    rng = random.Random(f"{seed}:scenarios")
    order = rng.sample(prompts, len(prompts))
    found = []
    for i in range(SCENARIOS):
        variant = VARIANTS[i % len(VARIANTS)]
        route = ROUTES[(i // len(VARIANTS) + i) % 2]
        prompt = order[i % len(order)]
        kwargs: dict[str, Any] = {
            "model": model,
            **prompt_kwargs(prompt, route),
            "max_tokens": rng.randint(max(1, max_tokens // 2), max_tokens),
            "temperature": 0.0,
        }
        constraint: Constraint | None = None
        if variant == "stop":
            kwargs["stop"] = ["\n\n", "#"]
        elif variant == "penalties":
            kwargs.update(presence_penalty=0.5, frequency_penalty=0.3)
        elif variant == "repetition":
            kwargs["extra_body"] = {"repetition_penalty": 1.2}
        elif variant in ("regex", "json"):
            constraint = variant
            constrain(kwargs, route, constraint)
        found.append(Scenario(f"g{i:02d} {route} {prompt.id} {variant}", route, kwargs, constraint))
    return found


def sampled(
    rng: random.Random, prompts: list[BenchPrompt], model: str, max_tokens: int
) -> tuple[Route, dict[str, Any], Constraint | None, list[str]]:
    """A sampled request's route, kwargs, constraint and features (temperature > 0)."""
    route: Route = rng.choice(ROUTES)
    kwargs: dict[str, Any] = {
        "model": model,
        **prompt_kwargs(rng.choice(prompts), route),
        "max_tokens": rng.randint(1, max_tokens),
        "temperature": round(rng.uniform(0.2, 1.3), 2),
    }
    extra: dict[str, Any] = {}
    features = ["sampled"]
    if rng.random() < 0.8:
        kwargs["seed"] = rng.randrange(1 << 31)
        features.append("seed")
    if rng.random() < 0.4:
        kwargs["top_p"] = round(rng.uniform(0.5, 0.99), 2)
        features.append("top_p")
    if rng.random() < 0.4:
        extra["top_k"] = rng.randint(1, 64)
        features.append("top_k")
    if rng.random() < 0.15:
        extra["min_p"] = round(rng.uniform(0.01, 0.2), 3)
        features.append("min_p")
    if rng.random() < 0.2:
        kwargs.update(presence_penalty=round(rng.uniform(-1, 1), 2),
                      frequency_penalty=round(rng.uniform(-1, 1), 2))  # fmt: skip
        extra["repetition_penalty"] = round(rng.uniform(1.0, 1.5), 2)
        features.append("penalties")
    constraint: Constraint | None = rng.choice(("regex", "json")) if rng.random() < 0.2 else None
    # a stop string could cut a constrained answer short; ignore_eos with one is refused
    if constraint is None and rng.random() < 0.2:
        kwargs["stop"] = rng.sample(["\n", "\n\n", ")", "return", "."], rng.randint(1, 4))
        features.append("stop")
    if constraint is None and rng.random() < 0.2:
        extra["ignore_eos"] = True
        features.append("ignore_eos")
    if extra:
        kwargs["extra_body"] = extra
    if constraint is not None:
        constrain(kwargs, route, constraint)
    return route, kwargs, constraint, features


@dataclass(frozen=True)
class Plan:
    """What the clients draw from: the model's name, the prompts, the greedy scenarios and
    the malformed requests."""

    model: str
    prompts: list[BenchPrompt]
    max_tokens: int
    scenarios: list[Scenario]
    bad: list[BadCall]


def draw(rng: random.Random, plan: Plan) -> Call | BadCall:
    """The next request of the client whose generator is `rng`."""
    if rng.random() < BAD_SHARE:
        return rng.choice(plan.bad)
    if rng.random() < GREEDY_SHARE:
        scenario = rng.choice(plan.scenarios)
        route, kwargs, constraint = (
            scenario.route,
            copy.deepcopy(scenario.kwargs),
            scenario.constraint,
        )
        features, greedy = ["greedy"], scenario.key
    else:
        route, kwargs, constraint, features = sampled(
            rng, plan.prompts, plan.model, plan.max_tokens
        )
        greedy = None
    if constraint is not None:
        features.append(constraint)
    delivery: Delivery = rng.choices(DELIVERIES, DELIVERY_WEIGHTS)[0]
    if rng.random() < 0.3:
        kwargs["n"] = rng.randint(2, MAX_N)
        features.append("n>1")
    if rng.random() < 0.3:
        top = rng.randint(0, 5)
        if route == "chat":
            kwargs.update(logprobs=True, top_logprobs=top)
        else:
            kwargs["logprobs"] = top
        features.append("logprobs")
    if delivery != "whole":
        kwargs.update(stream=True, stream_options={"include_usage": True})
    cancel_after = rng.randint(1, MAX_CANCEL_AFTER)
    return Call(route, kwargs, delivery, cancel_after, greedy, constraint, tuple(features))


def bad_calls(model: str, max_body_bytes: int, max_context: int) -> list[BadCall]:
    """The malformed requests: fields refused by name, values out of range or of the wrong
    type, missing fields, an unknown model, a grammar that does not compile, a prompt over
    the context, invalid JSON, a body that is no object, and a body over the size limit."""
    one = {"model": model, "prompt": "def add(a, b):", "max_tokens": 4}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases: list[tuple[str, Route, dict[str, Any] | bytes, int, str]] = [
        ("refused field", "completions", {**one, "use_beam_search": True}, 400, "use_beam_search"),
        ("refused chat field", "chat", {**chat, "functions": [{"name": "f"}]}, 400, "functions"),
        ("best_of", "completions", {**one, "best_of": 3}, 400, "best_of"),
        ("temperature < 0", "chat", {**chat, "temperature": -0.5}, 400, "temperature"),
        ("top_p > 1", "completions", {**one, "top_p": 1.5}, 400, "top_p"),
        ("n = 0", "completions", {**one, "n": 0}, 400, "n"),
        ("n too large", "chat", {**chat, "n": 17}, 400, "n"),
        ("logprobs too large", "completions", {**one, "logprobs": 21}, 400, "logprobs"),
        ("max_tokens = 0", "chat", {**chat, "max_tokens": 0}, 400, "max_tokens"),
        ("penalty out of range", "completions", {**one, "presence_penalty": 5}, 400,
         "presence_penalty"),
        ("logit_bias key", "completions", {**one, "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ("five stop strings", "chat", {**chat, "stop": list("abcde")}, 400, "stop"),
        ("wrong type", "completions", {**one, "max_tokens": "5"}, 422, "max_tokens"),
        ("boolean as number", "chat", {**chat, "temperature": True}, 422, "temperature"),
        ("missing prompt", "completions", {"model": model}, 422, "prompt"),
        ("empty messages", "chat", {**chat, "messages": []}, 422, "messages"),
        ("unknown model", "completions", {**one, "model": model + "-nope"}, 404, "model"),
        ("regex does not compile", "completions", {**one, "guided_regex": "(("}, 400,
         "guided_regex"),
        ("constraint with ignore_eos", "completions",
         {**one, "guided_regex": REGEX, "ignore_eos": True}, 400, "ignore_eos"),
        ("prompt over the context", "completions", {**one, "prompt": "a b " * max_context},
         400, "prompt"),
        ("invalid JSON", "chat", json.dumps(chat).encode()[:-7], 400, "JSON"),
        ("body not an object", "completions", b"[1, 2]", 422, "object"),
        ("body too large", "completions", {**one, "prompt": "x" * max_body_bytes}, 413,
         "larger than"),
    ]  # fmt: skip
    return [
        BadCall(case, route, body if isinstance(body, bytes) else json.dumps(body).encode(),
                status, names)
        for case, route, body, status, names in cases
    ]  # fmt: skip
