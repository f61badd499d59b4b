"""Constrained decoding: grammars from schemas and tools, the logits mask, and replies that must match."""

import json

import jsonschema
import pytest
import torch

from h2o_cache import SamplingParams
from server.engine import ChatRequest
from server.engine.grammar import GrammarError, Grammars, constrain, output_grammar
from server.engine.tool_calls import Tools, parse
from tests.engine.conftest import ask, collect

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["ok", "color", "tags"], "additionalProperties": False}
TOOLS = [{"name": "paint", "parameters": {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}},
                                          "required": ["color"], "additionalProperties": False}},
         {"name": "wait", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}]


def test_free_text_has_no_grammar_and_a_bad_schema_does_not_compile():
    assert output_grammar(None, None) is None and output_grammar(None, Tools(TOOLS, "auto")) is None
    assert output_grammar(None, Tools(TOOLS, "none")) is None
    with pytest.raises(GrammarError):
        output_grammar({"type": "integerx"}, None)
    with pytest.raises(GrammarError):
        output_grammar(None, Tools([{"name": "f", "parameters": {"type": "nope"}}], "required"))


def test_the_mask_leaves_only_allowed_tokens_and_unconstrained_rows_alone(exact_tokenizer):
    grammars = Grammars(exact_tokenizer, 259)
    matcher = grammars.matcher(output_grammar(SCHEMA, None))
    logits = torch.randn(2, 259)
    masked = constrain(logits, [None, matcher])
    assert torch.equal(masked[0], logits[0])
    allowed = torch.isfinite(masked[1]).nonzero()[:, 0].tolist()
    assert allowed == exact_tokenizer.encode("{")  # a JSON object starts with its brace, nothing else
    assert not torch.equal(masked, logits) and torch.isfinite(logits).all()  # the input is left as it was
    half = constrain(logits.bfloat16(), [None, matcher])  # the torch path (other dtypes, devices)
    assert torch.equal(torch.isfinite(half), torch.isfinite(masked))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_a_constrained_reply_validates_against_its_schema_and_stops_by_itself(make_engine, temperature):
    engine = make_engine(exact=True, max_batch_size=4)
    params = SamplingParams(max_new_tokens=120, temperature=temperature, seed=7)
    requests = [ChatRequest([{"role": "user", "content": f"colors {i}"}], params, grammar=output_grammar(SCHEMA, None))
                for i in range(2)] + [ask("free text alongside", SamplingParams(max_new_tokens=12, ignore_eos=True))]
    replies = [await collect(h) for h in [await engine.submit(r) for r in requests]]
    for reply in replies[:2]:
        jsonschema.validate(json.loads(reply.text), SCHEMA)
        assert reply.finish.finish_reason == "stop"
    assert replies[2].finish.finish_reason == "length" and len(replies[2].token_ids) == 12


async def test_a_forced_tool_call_is_a_call_of_that_function_and_the_loop_continues_the_session(make_engine):
    engine = make_engine(exact=True)
    tools = Tools(TOOLS, "paint", parallel=False)
    params = SamplingParams(max_new_tokens=80, temperature=1.0, seed=3)
    first = await collect(await engine.submit(ChatRequest(
        [{"role": "user", "content": "paint it"}], params, tools=tools, grammar=output_grammar(None, tools))))
    [call] = first.finish.tool_calls
    assert first.finish.finish_reason == "tool_calls" and first.text == ""
    assert call.name == "paint" and json.loads(call.arguments)["color"] in ("red", "blue")
    history = [{"role": "user", "content": "paint it"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "done"}]
    second = await collect(await engine.submit(ChatRequest(history, SamplingParams(max_new_tokens=4, ignore_eos=True),
                                                           tools=Tools(TOOLS, "auto"))))
    assert second.session_id == first.session_id
    assert second.finish.usage.cached_tokens == first.finish.usage.conversation_tokens > 0


async def test_required_calls_may_be_parallel_and_each_parses(make_engine):
    engine = make_engine(exact=True)
    tools = Tools(TOOLS, "required")
    reply = await collect(await engine.submit(ChatRequest(
        [{"role": "user", "content": "go"}], SamplingParams(max_new_tokens=200, temperature=1.0, seed=1),
        tools=tools, grammar=output_grammar(None, tools))))
    assert reply.finish.finish_reason == "tool_calls"
    assert reply.finish.tool_calls and {c.name for c in reply.finish.tool_calls} <= {"paint", "wait"}
