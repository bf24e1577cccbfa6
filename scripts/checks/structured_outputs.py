"""Structured outputs and tool calls through the HTTP API of the local worker (SmolLM2-135M-
Instruct + demo adapters), with the official `openai` client; base URL from argv[1].

- JSON schemas (nested objects, arrays with minItems, enums, anyOf, string pattern, integer
  bounds): every greedy and every sampled answer, with and without an adapter, sent at once
  beside unconstrained requests (so they share batches), parses and validates with
  `jsonschema`, unless `finish_reason` is `length`;
- `structured_outputs` / `guided_*` regex and choice answers match; completions too;
- a schema llguidance cannot compile is a 400 naming it;
- `chat.completions.parse` with a Pydantic model;
- tools: tool_choice named and required always give tool_calls whose arguments validate
  against the function's parameters; streamed, each call's arguments come in more than one
  delta after its head, and the deltas reassemble to the whole answer exactly.
"""
import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pydantic

base = sys.argv[1]
c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
BASE = "smollm2-135m-instruct"

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    "colors": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    "shape": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "circle"}, "radius": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["kind", "radius"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["kind", "side"],
                "additionalProperties": False,
            },
        ]
    },
    "code": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "ok": {"type": "boolean"}},
        "required": ["code", "ok"],
        "additionalProperties": False,
    },
}
ASK = {
    "person": "Describe a person who lives in Paris.",
    "colors": "List some colors you like.",
    "shape": "Describe a shape.",
    "code": "Give me a product code.",
}


def chat(model, name, seed=None, stream=False):
    kw = dict(temperature=0) if seed is None else dict(temperature=1.0, seed=seed)
    return c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": ASK[name]}],
        max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}},
        **kw,
    )


def free(i):
    return c.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": f"Tell me a story about the number {i}."}], max_tokens=40, temperature=0.7, seed=i
    )


jobs = []
# One batch: per schema a greedy answer of the base and a sampled one of an adapter, beside
# two free requests (a debug build on two cores: kept small enough for requestTimeoutSeconds).
with ThreadPoolExecutor(max_workers=10) as pool:
    frees = [pool.submit(free, i) for i in range(2)]
    for name in SCHEMAS:
        for model, seed in ((BASE, None), ("french", 1)):
            jobs.append((name, model, seed, pool.submit(chat, model, name, seed)))
    results = [(n, m, s, f.result()) for n, m, s, f in jobs]
    for f in frees:
        assert f.result().choices[0].message.content, f.result()

stopped = 0
for name, model, seed, r in results:
    ch = r.choices[0]
    if ch.finish_reason == "length":
        print(f"  cut by max_tokens: {name} {model} seed={seed}: {ch.message.content!r}")
        continue
    assert ch.finish_reason == "stop", (name, model, seed, ch)
    v = json.loads(ch.message.content)
    jsonschema.validate(v, SCHEMAS[name])
    stopped += 1
print(f"json_schema: {stopped} of {len(results)} answers complete and valid")
assert stopped >= len(results) * 3 // 4, "most answers should end within 120 tokens"

# json_object: any JSON object.
r = c.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
                              max_tokens=120, temperature=0, response_format={"type": "json_object"})
if r.choices[0].finish_reason == "stop":
    assert isinstance(json.loads(r.choices[0].message.content), dict), r

# vLLM's fields: regex and choice, new and old spelling, chat and completions.
for body in ({"structured_outputs": {"regex": "[a-z]{3,8}@[a-z]{3,8}\\.com"}}, {"guided_regex": "[a-z]{3,8}@[a-z]{3,8}\\.com"}):
    for seed in (None, 5):
        kw = dict(temperature=0) if seed is None else dict(temperature=1.0, seed=seed)
        r = c.chat.completions.create(model="french", messages=[{"role": "user", "content": "An email address?"}],
                                      max_tokens=40, extra_body=body, **kw)
        assert re.fullmatch(r"[a-z]{3,8}@[a-z]{3,8}\.com", r.choices[0].message.content), r
for body in ({"structured_outputs": {"choice": ["positive", "negative"]}}, {"guided_choice": ["positive", "negative"]}):
    r = c.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "I love it! Sentiment?"}],
                                  max_tokens=10, temperature=0, extra_body=body)
    assert r.choices[0].message.content in ("positive", "negative"), r
r = c.completions.create(model=BASE, prompt="The year was", max_tokens=8, temperature=0,
                         extra_body={"guided_regex": " [0-9]{4}"})
assert re.fullmatch(r" [0-9]{4}", r.choices[0].text), r
r = c.completions.create(model=BASE, prompt="Answer:", max_tokens=30, temperature=0,
                         extra_body={"structured_outputs": {"grammar": 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]+/'}})
if r.choices[0].finish_reason == "stop":
    assert re.fullmatch(r"\([0-9]+(,[0-9]+)*\)", r.choices[0].text), r

# Refusals name the problem.
for body, code in (
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}}}, "invalid_schema"),
    ({"guided_regex": "(unclosed"}, "invalid_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "conflicting_guides"),
    ({"response_format": {"type": "xml"}}, "invalid_response_format"),
):
    try:
        c.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "x"}], max_tokens=5, extra_body=body)
        raise AssertionError(f"accepted: {body}")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["code"] == code, (body, e.body)


# The client's parse() with a Pydantic model.
class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=50_000_000)
    capital: bool


class Answer(pydantic.BaseModel):
    cities: list[City] = pydantic.Field(min_length=1, max_length=2)


parse = getattr(c.chat.completions, "parse", None) or c.beta.chat.completions.parse
r = parse(model=BASE, messages=[{"role": "user", "content": "Name a big city in France."}], response_format=Answer,
          max_tokens=200, temperature=0)
if r.choices[0].finish_reason == "stop":
    assert isinstance(r.choices[0].message.parsed, Answer), r
    print("parse():", r.choices[0].message.parsed)
else:
    print("parse(): cut by max_tokens", r.choices[0].message.content)

# Tools: named and required are enforced by the grammar.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}}, "required": ["tz"], "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK_TOOL = [{"role": "user", "content": "What is the weather in Paris?"}]
for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
    for model, seed in ((BASE, None), ("french", 3)):
        if True:
            kw = dict(temperature=0) if seed is None else dict(temperature=1.0, seed=seed)
            r = c.chat.completions.create(model=model, messages=ASK_TOOL, tools=[WEATHER, TIME], tool_choice=choice,
                                          max_tokens=120, **kw)
            ch = r.choices[0]
            if ch.finish_reason == "length":
                print("  tool call cut by max_tokens", choice, model, seed)
                continue
            assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, (choice, model, ch)
            for call in ch.message.tool_calls:
                assert call.id.startswith("call_") and call.type == "function", call
                if isinstance(choice, dict):
                    assert call.function.name == "get_weather", call
                jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])

# Streamed, named and required: each call's first delta carries its index, id, type and name
# with empty arguments, the arguments follow in more than one piece (as the model writes them),
# and the pieces reassemble to the whole answer's arguments exactly (same greedy request).
for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
    kw = dict(model=BASE, messages=ASK_TOOL, tools=[WEATHER], tool_choice=choice, max_tokens=120, temperature=0)
    whole = c.chat.completions.create(**kw).choices[0]
    calls, finish = {}, None
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.id.startswith("call_") and d.type == "function", d
                    assert d.function.name and d.function.arguments == "", d
                    calls[d.index] = {"id": d.id, "name": d.function.name, "pieces": []}
                else:
                    assert d.id is None and d.function.name is None and d.function.arguments, d
                    calls[d.index]["pieces"].append(d.function.arguments)
    assert finish == whole.finish_reason == "tool_calls", (finish, whole.finish_reason)
    for i in calls:
        assert len(calls[i]["pieces"]) > 1, ("the arguments came in one piece", choice, calls[i])
    got = [(calls[i]["name"], "".join(calls[i]["pieces"])) for i in sorted(calls)]
    want = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or []]
    assert got == want, (got, want)
    print(f"  streamed {choice if isinstance(choice, str) else 'named'} call: "
          f"{sum(len(calls[i]['pieces']) for i in calls)} argument pieces reassembled")

# History with the call and its result renders (the model answers in text).
if whole.message.tool_calls:
    t = whole.message.tool_calls[0]
    history = ASK_TOOL + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": t.id, "type": "function", "function": {"name": t.function.name, "arguments": t.function.arguments}}]},
        {"role": "tool", "tool_call_id": t.id, "content": json.dumps({"temperature": 21})},
    ]
    r = c.chat.completions.create(model=BASE, messages=history, tools=[WEATHER], max_tokens=30, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls"), r
print("structured outputs and tool calls: OK")
