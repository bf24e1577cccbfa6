"""The Responses API of the local worker (SmolLM2-135M-Instruct + demo adapters) with the
official `openai` client and the OpenAI Agents SDK; base URL from argv[1].

- responses.create: a text with instructions, and input items; usage counts both sides;
- responses.parse with a Pydantic model: the parsed object validates;
- a named function tool and `required` over two tools: every call's arguments validate against
  its function's parameters (`jsonschema`);
- a two-turn tool loop: the call and its function_call_output fed back, answered;
- streaming: events in order (created, in_progress ... completed/incomplete), sequence numbers
  counting up, the text deltas joined equal to the streamed response's text and to the same
  request's whole answer (greedy);
- an adapter by name (`model: french`), named in `mole`;
- bad inputs: 4xx with stable codes (an unknown item type, a function_call_output without its
  call, an image on this text pool, previous_response_id);
- the Agents SDK: an agent with one function tool and a typed output, its model the Responses
  API at this base URL, calls the tool and finishes with a valid typed output.
"""
import asyncio
import json
import sys
import urllib.error
import urllib.request

import jsonschema
import openai
import pydantic

base = sys.argv[1]
c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
BASE = "smollm2-135m-instruct"
checked = []


def ok(what):
    checked.append(what)
    print(f"responses_check: {what}: ok")


# A text, with instructions.
r = c.responses.create(model=BASE, input="What is the capital of France?",
                       instructions="Answer in one short sentence.", max_output_tokens=32,
                       temperature=0)
assert r.object == "response" and r.id.startswith("resp_"), r
assert r.status in ("completed", "incomplete"), r.status
assert r.output_text, r
assert r.usage.input_tokens > 10 and r.usage.output_tokens > 0, r.usage
assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
assert r.instructions == "Answer in one short sentence." and r.store is False
ok("responses.create with instructions")

# Input items.
r = c.responses.create(model=BASE, max_output_tokens=16, temperature=0, input=[
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]},
])
assert r.output and r.output[0].type == "message" and r.output_text, r
ok("responses.create with input items")


# responses.parse with a Pydantic model.
class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=100_000_000)


p = c.responses.parse(model=BASE, input="A big city in France?", text_format=City,
                      max_output_tokens=100, temperature=0)
assert p.status == "completed", p
assert isinstance(p.output_parsed, City), p.output_parsed
ok(f"responses.parse -> {p.output_parsed!r}")

# Function tools.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
tools = [
    {"type": "function", "name": "get_weather", "description": "The weather in a city.",
     "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "description": "The time in a zone.",
     "parameters": TIME, "strict": True},
]
params = {"get_weather": WEATHER, "get_time": TIME}


def calls_of(r):
    out = [i for i in r.output if i.type == "function_call"]
    for call in out:
        assert call.call_id.startswith("call_"), call
        jsonschema.validate(json.loads(call.arguments), params[call.name])
    return out


question = "What is the weather in Paris?"
r = c.responses.create(model=BASE, input=question, tools=tools, max_output_tokens=80,
                       temperature=0, tool_choice={"type": "function", "name": "get_weather"})
named = calls_of(r)
assert len(named) == 1 and named[0].name == "get_weather", r.output
ok(f"a named function tool -> {named[0].arguments}")
r = c.responses.create(model=BASE, input="What time is it in Berlin?", tools=tools,
                       max_output_tokens=80, temperature=0, tool_choice="required",
                       parallel_tool_calls=False)
required = calls_of(r)
assert len(required) == 1, r.output
ok(f"tool_choice required -> {required[0].name}({required[0].arguments})")

# A two-turn tool loop: the call and its output fed back.
turn2 = [{"role": "user", "content": question}] + [i.model_dump(exclude_none=True) for i in named]
turn2.append({"type": "function_call_output", "call_id": named[0].call_id,
              "output": json.dumps({"weather": "sunny", "celsius": 21})})
r = c.responses.create(model=BASE, input=turn2, tools=tools, max_output_tokens=48, temperature=0,
                       tool_choice="none")
assert r.output_text, r.output
ok(f"a two-turn tool loop -> {r.output_text[:60]!r}")

# Streaming joins to the whole answer.
ask = dict(model=BASE, input="Name three colors.", max_output_tokens=24, temperature=0)
whole = c.responses.create(**ask)
events = list(c.responses.create(stream=True, **ask))
kinds = [e.type for e in events]
assert kinds[:2] == ["response.created", "response.in_progress"], kinds
assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
assert [e.sequence_number for e in events] == list(range(len(events)))
deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
final = events[-1].response
assert deltas == final.output_text == whole.output_text, (deltas, final.output_text, whole.output_text)
assert final.usage.output_tokens == whole.usage.output_tokens
for kind in ("response.output_item.added", "response.content_part.added",
             "response.output_text.done", "response.output_item.done"):
    assert kind in kinds, kinds
ok(f"streaming: {len(events)} events, the deltas join to the whole answer")
# The helper joins the events itself and wants the answer complete (`response.completed`).
with c.responses.stream(model=BASE, input="What is 2+2?", max_output_tokens=64,
                        temperature=0) as s:
    text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
    assert text == s.get_final_response().output_text
ok("responses.stream")

# An adapter by name.
r = c.responses.create(model="french", input="What is the capital of Italy?",
                       max_output_tokens=20, temperature=0)
assert r.model == "french" and r.model_extra["mole"]["adapter"] == "french", r
ok(f"an adapter by name -> {r.output_text!r}")


# Bad inputs: 4xx with stable codes.
def refused(body):
    req = urllib.request.Request(f"{base}/v1/responses", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]["code"]
    return 200, None


for body, want in [
    ({"model": BASE, "input": [{"type": "web_search_call", "id": "ws_1"}]}, (400, "invalid_input")),
    ({"model": BASE, "input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
     (400, "unknown_call_id")),
    ({"model": BASE, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}]},
     (400, "images_not_supported")),
    ({"model": BASE, "input": "x", "previous_response_id": "resp_1"}, (400, "unsupported_field")),
    ({"model": BASE, "input": "x", "tools": [{"type": "web_search"}]}, (400, "invalid_tools")),
]:
    got = refused(body)
    assert got == want, (body, got)
ok("bad inputs are 4xx with stable codes")


# The OpenAI Agents SDK: one function tool and a typed output.
async def agent_run():
    import dataclasses

    import agents
    from agents import Agent, AgentHooks, ModelSettings, OpenAIResponsesModel, Runner, function_tool

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"sunny, 21 C in {city}"

    class Report(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=20)
        sunny: bool

    class AnswerAfterTheTool(AgentHooks):
        """A 135M model does not decide on its own when it has what it needs (left to choose,
        it calls the tool again each turn): the first turn must call the tool, the turns after
        it must answer. The server is what is checked here, each way of asking included."""

        async def on_tool_end(self, context, agent, tool, result):
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    agent = Agent(
        name="weather",
        instructions="Find the weather with get_weather, then report it.",
        tools=[get_weather],
        output_type=Report,
        model=OpenAIResponsesModel(model=BASE, openai_client=client),
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=120
        ),
        reset_tool_choice=False,
        hooks=AnswerAfterTheTool(),
    )
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    return result, asked


result, asked = asyncio.run(agent_run())
assert asked, "the agent called its tool"
assert type(result.final_output).__name__ == "Report", result.final_output
ok(f"an Agents SDK agent -> tool called with {asked}, final output {result.final_output!r}")
print(f"responses_check: ok ({len(checked)} checks)")
