"""Tool calls in "auto" mode, parsed out of the model's text (server/tools.py): the Qwen2.5
family's tagged calls, and the untagged ones Qwen2.5-Coder writes; whole and streamed in
any deltas, the same calls and the same content. Through the server: test_server_params.py."""

from __future__ import annotations

import json

import pytest


def test_auto_tool_calls_are_parsed_out_of_the_text():
    from understudy.server.tools import parse_tool_calls

    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        "</tool_call>\n<tool_call>{not json}</tool_call>"
    )
    content, calls = parse_tool_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert content == "Let me look.\n\n<tool_call>{not json}</tool_call>"
    assert parse_tool_calls("no calls <tool_call> unclosed") == (
        "no calls <tool_call> unclosed",
        [],
    )


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_tool_calls_equal_the_whole_parse(step):
    """Whatever the deltas, the stream yields the same calls, and content never shows a
    piece of a tag that turns out to open a call."""
    from understudy.server.tools import ToolCallStream, parse_tool_calls

    text = 'Sure. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> done <tool'
    stream = ToolCallStream()
    content, calls = "", []
    for i in range(0, len(text), step):
        piece, found = stream.push(text[i : i + step])
        content += piece
        calls += found
        assert "<tool_call" not in content
    rest, more = stream.finish()
    content, calls = content + rest, calls + more
    whole_content, whole_calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    assert content.strip() == "Sure.  done <tool" and whole_content == "Sure.  done <tool"


# Qwen2.5-Coder (the default pair's family) writes its calls in a code block, or alone
CODER_CASES = [
    (  # a code block naming a tool: a call, and the text beside it is content
        'Sure.\n```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```\nDone.',
        "Sure.\n\nDone.",
        [("get_weather", {"city": "Oslo"})],
    ),
    (  # the whole output one call object, vLLM's "parameters" key
        '  {"name": "get_weather", "parameters": {"city": "Paris", "days": true}}',
        "",
        [("get_weather", {"city": "Paris", "days": True})],
    ),
    (  # an unclosed code block that holds a call (cut by a stop string)
        '```json\n{"name": "get_weather", "arguments": {}}\n',
        "",
        [("get_weather", {})],
    ),
    ('```json\n{"name": "other", "arguments": {}}\n```', None, []),  # not one of the tools
    ("```python\ndef add(a, b):\n    return a + b\n```\nok `x`", None, []),  # code
    ('{"name": "get_weather", "arguments": "Oslo"}', None, []),  # arguments not an object
    ('{"color": "red"}', None, []),  # JSON that is no call
]


@pytest.mark.parametrize("text, content, calls", CODER_CASES)
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_untagged_calls_of_the_request_tools_are_parsed(text, content, calls, step):
    """Whole and streamed in any deltas, the same calls and the same content; without a
    call the content is the text as it is."""
    from understudy.server.tools import ToolCallStream, parse_tool_calls

    names = ("get_weather",)
    whole_content, whole_calls = parse_tool_calls(text, names)
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == calls
    assert whole_content == (text if content is None else content)
    stream = ToolCallStream(names)
    streamed, found = "", []
    for i in range(0, len(text), step):
        piece, more = stream.push(text[i : i + step])
        streamed, found = streamed + piece, found + more
    rest, more = stream.finish()
    streamed, found = streamed + rest, found + more
    assert [(c.name, c.arguments) for c in found] == [(c.name, c.arguments) for c in whole_calls]
    assert streamed.strip() == whole_content.strip()
    if calls:
        assert "get_weather" not in streamed  # a call's text is never sent as content
