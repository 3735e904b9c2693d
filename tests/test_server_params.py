"""The OpenAI parameters through the real server (uvicorn on a thread, tiny models, method
"draft" with speculation on) and the official `openai` client: structured output, logprobs,
n choices, penalties / bias / min_tokens, echo, tools, and the 400s for what is refused."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import openai
import pytest
import torch

from server_helpers import serve_in_thread
from understudy import Engine
from understudy.server.app import create_app

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "ok", "n"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "boolean"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
# the Qwen2.5 family's way of showing tools and calls, on the tiny tokenizer's markers
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_end|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "\n</tools>{% endif %}"
    "{% for m in messages %}<|im_end|>{{ m['role'] }}\n"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "\n</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_end|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tools_target(tiny_pair, tmp_path_factory):
    """The tiny target with a chat template that renders tools."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tools") / "target"
    shutil.copytree(tiny_pair[0], path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def engine(tools_target, tiny_pair):
    return Engine.from_pretrained(
        target=tools_target, draft=tiny_pair[1], dtype="float32", num_speculative_tokens=2
    )


@pytest.fixture(scope="module")
def url(engine):
    with serve_in_thread(create_app(engine, model_name="tiny")) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(client, **kwargs):
    return client.completions.create(model="tiny", **kwargs)


def chat(client, **kwargs):
    return client.chat.completions.create(model="tiny", **kwargs)


MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


def test_json_schema_response_parses_and_validates(client):
    for temperature, seed in ((0.0, None), (1.0, 3), (1.0, 4)):
        response = chat(
            client,
            messages=MESSAGES,
            temperature=temperature,
            seed=seed,
            max_tokens=80,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": SCHEMA},
            },
        )
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_guided_regex_and_choice(client):
    regex = complete(
        client,
        prompt="def",
        max_tokens=30,
        temperature=1.0,
        seed=1,
        extra_body={"guided_regex": "[0-9]{3}-[a-c]{2}"},
    )
    assert __import__("re").fullmatch("[0-9]{3}-[a-c]{2}", regex.choices[0].text)
    picked = complete(
        client,
        prompt="def",
        max_tokens=30,
        temperature=1.0,
        seed=2,
        extra_body={"guided_choice": ["alpha", "beta"]},
    )
    assert picked.choices[0].text in ("alpha", "beta")


def test_logit_bias_and_min_tokens(client, engine):
    """EOS (id 0) at +100 ends generation at once, unless min_tokens holds it off."""
    eos = engine.target.eos_token_ids[0]
    quick = complete(client, prompt="def", max_tokens=20, temperature=0.0, logit_bias={eos: 100})
    assert quick.usage.completion_tokens == 1 and quick.choices[0].finish_reason == "stop"
    held = complete(
        client,
        prompt="def",
        max_tokens=20,
        temperature=0.0,
        logit_bias={eos: 100},
        extra_body={"min_tokens": 5},
    )
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"


def test_penalties_change_greedy_output_as_the_engine_does(client, engine):
    """The server's penalised output is the engine's (method none) with the same params."""
    from understudy import SamplingParams

    plain = engine.with_method("none")
    for kwargs in (
        {"frequency_penalty": 1.5},
        {"presence_penalty": 1.5},
        {"repetition_penalty": 1.8},
    ):
        body = {k: v for k, v in kwargs.items() if k != "repetition_penalty"}
        extra = (
            {"repetition_penalty": kwargs["repetition_penalty"]}
            if "repetition_penalty" in kwargs
            else {}
        )
        got = complete(
            client,
            prompt="def add",
            max_tokens=24,
            temperature=0.0,
            **body,
            extra_body={"ignore_eos": True, **extra},
        )
        want = plain.generate(
            "def add", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **kwargs)
        )
        free = plain.generate(
            "def add", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        )
        assert got.choices[0].text == want.text != free.text, kwargs


def reference_logprobs(target_path: str, ids: list[int]) -> torch.Tensor:
    """The target's own log-softmax at every position, from transformers: [len(ids), V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), -1)


def test_completion_logprobs_are_the_targets(client, engine, tools_target):
    """Each token's logprob is the target's raw log-softmax there, as transformers computes
    it; the server's sampled tokens are the engine's with the same seed."""
    from understudy import SamplingParams

    prompt = "for i in range"
    response = complete(
        client,
        prompt=prompt,
        max_tokens=12,
        temperature=1.0,
        seed=7,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    logprobs = response.choices[0].logprobs
    same = engine.generate(
        prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    )
    assert same.text == response.choices[0].text
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 12
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)  # dicts: equal strings merge
    prompt_ids = engine.encode(prompt)
    ids = prompt_ids + same.token_ids
    ref = reference_logprobs(tools_target, ids)
    for i, got in enumerate(logprobs.token_logprobs):
        want = float(ref[len(prompt_ids) + i - 1, ids[len(prompt_ids) + i]])
        assert got == pytest.approx(want, abs=1e-3)
        assert max(logprobs.top_logprobs[i].values()) >= got - 1e-6
        best = float(ref[len(prompt_ids) + i - 1].max())
        assert max(logprobs.top_logprobs[i].values()) == pytest.approx(best, abs=1e-3)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs_streamed_equal_whole(client):
    kwargs = dict(
        messages=MESSAGES, max_tokens=10, temperature=1.0, seed=11, logprobs=True, top_logprobs=2
    )
    whole = chat(client, **kwargs).choices[0].logprobs.content
    assert len(whole) == 10 and all(len(e.top_logprobs) == 2 for e in whole)
    assert all(bytes(e.bytes).decode(errors="replace") for e in whole)
    streamed = []
    for chunk in chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                streamed += choice.logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]


def test_n_choices_are_seeded_streams(client):
    kwargs = dict(prompt="class Stack:", max_tokens=12, temperature=1.0)
    many = complete(client, n=3, seed=5, **kwargs)
    assert [c.index for c in many.choices] == [0, 1, 2]
    for i, choice in enumerate(many.choices):
        assert choice.text == complete(client, seed=5 + i, **kwargs).choices[0].text
    assert many.usage.completion_tokens == sum(
        complete(client, seed=5 + i, **kwargs).usage.completion_tokens for i in range(3)
    )
    texts = {0: "", 1: "", 2: ""}
    for chunk in complete(client, n=3, seed=5, stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[i] for i in range(3)] == [c.text for c in many.choices]


def test_echo_prepends_the_prompt(client):
    response = complete(client, prompt="def add", max_tokens=5, temperature=0.0, echo=True)
    plain = complete(client, prompt="def add", max_tokens=5, temperature=0.0)
    assert response.choices[0].text == "def add" + plain.choices[0].text


def test_named_tool_choice_returns_a_valid_call(client):
    for stream in (False, True):
        kwargs = dict(
            messages=MESSAGES,
            tools=[WEATHER],
            max_tokens=60,
            temperature=0.0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        if not stream:
            message = chat(client, **kwargs).choices[0].message
            calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
            assert message.content is None
        else:
            calls = []
            for chunk in chat(client, stream=True, **kwargs):
                for choice in chunk.choices:
                    for call in choice.delta.tool_calls or []:
                        calls.append((call.function.name, call.function.arguments))
        assert len(calls) == 1 and calls[0][0] == "get_weather"
        jsonschema.validate(json.loads(calls[0][1]), WEATHER["function"]["parameters"])


def test_required_tool_choice_returns_calls(client):
    message = (
        chat(
            client,
            messages=MESSAGES,
            tools=[WEATHER],
            max_tokens=80,
            temperature=0.0,
            tool_choice="required",
            parallel_tool_calls=False,
        )
        .choices[0]
        .message
    )
    assert len(message.tool_calls) == 1 and message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(
        json.loads(message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"]
    )


def test_tool_history_renders_through_the_template(client):
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Oslo", "days": true}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    response = chat(client, messages=messages, tools=[WEATHER], max_tokens=4, temperature=0.0)
    assert response.usage.prompt_tokens > 40


def _error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(prompt="x", logit_bias={"99999": 1}), "logit_bias"),
        (dict(prompt="x", logit_bias={"abc": 1}), "logit_bias"),
        (dict(prompt="x", logprobs=21), "logprobs"),
        (dict(prompt="x", echo=True, logprobs=1), "echo"),
        (dict(prompt="x", n=17), "n"),
        (dict(prompt="x", best_of=3), "best_of"),
        (dict(prompt="x", extra_body={"repetition_penalty": 0.0}), "repetition_penalty"),
        (dict(prompt="x", extra_body={"min_tokens": 99, "max_tokens": 5}), "min_tokens"),
        (
            dict(prompt="x", extra_body={"guided_regex": "(", "guided_choice": ["a"]}),
            "guided_choice",
        ),
    ],
)
def test_refused_parameters_are_named(client, kwargs, param):
    error = _error(lambda: complete(client, **kwargs))
    assert error.status_code == 400 and error.body["param"] == param, error.body


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(tool_choice="auto"), "tool_choice"),
        (dict(tools=[WEATHER], parallel_tool_calls=False), "parallel_tool_calls"),
        (
            dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
        ),
        (
            dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
            "tool_choice",
        ),
    ],
)
def test_refused_chat_parameters_are_named(client, kwargs, param):
    error = _error(lambda: chat(client, messages=MESSAGES, **kwargs))
    assert error.status_code == 400 and error.body["param"] == param, error.body


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"guided_json": {"type": "nope"}}, "guided_json"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
         "response_format"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_does_not_compile_is_a_400_naming_its_field(url, extra, param, stream):
    body = {"model": "tiny", "prompt": "x", "stream": stream, **extra}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and "does not compile" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(extra_body={"use_beam_search": True}), "use_beam_search"),
        (dict(extra_body={"prompt_logprobs": 1}), "prompt_logprobs"),
        (dict(extra_body={"skip_special_tokens": False}), "skip_special_tokens"),
        (dict(extra_body={"allowed_token_ids": [1, 2]}), "allowed_token_ids"),
        (dict(extra_body={"length_penalty": 0.5}), "length_penalty"),
    ],
)
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_fields_we_do_not_implement_are_refused_by_name(client, kwargs, param, endpoint):
    """Known fields that would change the reply are refused, never silently ignored."""

    def call():
        if endpoint == "chat":
            return chat(client, messages=MESSAGES, max_tokens=2, **kwargs)
        return complete(client, prompt="x", max_tokens=2, **kwargs)

    error = _error(call)
    assert error.status_code == 400 and error.body["param"] == param, error.body


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"echo": True}, "echo"),
        ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"modalities": ["text", "audio"]}, "modalities"),
    ],
)
def test_chat_fields_we_do_not_implement_are_refused_by_name(client, extra, param):
    error = _error(lambda: chat(client, messages=MESSAGES, max_tokens=2, extra_body=extra))
    assert error.status_code == 400 and error.body["param"] == param, error.body


def test_those_fields_asking_for_nothing_and_unknown_fields_are_accepted(client):
    neutral = {"use_beam_search": False, "skip_special_tokens": True, "prompt_logprobs": None,
               "echo": False, "modalities": ["text"], "function_call": "none",
               "add_generation_prompt": True, "store": True, "metadata": {"a": "b"}}  # fmt: skip
    want = chat(client, messages=MESSAGES, max_tokens=6, temperature=0.0)
    got = chat(client, messages=MESSAGES, max_tokens=6, temperature=0.0, extra_body=neutral)
    assert got.choices[0].message.content == want.choices[0].message.content


def test_tools_need_a_template_that_renders_them(tiny_pair):
    engine = Engine.from_pretrained(target=tiny_pair[0], method="none", dtype="float32")
    with serve_in_thread(create_app(engine, model_name="tiny")) as base:
        plain = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        error = _error(lambda: chat(plain, messages=MESSAGES, tools=[WEATHER]))
    assert error.status_code == 400 and error.body["param"] == "tools"


def test_auto_takes_a_call_written_in_a_code_block(client):
    """Through the server, whole and streamed: the tiny model is held (guided_regex) to
    the answer Qwen2.5-Coder gives, a call in a ```json block; tool_choice "auto" finds it."""
    block = '```json\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": false}}\n```'
    regex = "".join("\\" + ch if ch in "{}[]().*+?^$|\\" else ch for ch in block)
    kwargs = dict(messages=MESSAGES, tools=[WEATHER], max_tokens=80, temperature=0.0,
                  extra_body={"guided_regex": regex})  # fmt: skip
    choice = chat(client, **kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Oslo", "days": False}
    )  # fmt: skip
    calls, content, finish = [], "", None
    for chunk in chat(client, stream=True, **kwargs):
        for c in chunk.choices:
            calls += [(d.function.name, d.function.arguments) for d in c.delta.tool_calls or []]
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert calls == [(call.function.name, call.function.arguments)]
    assert content == "" and finish == "tool_calls"
