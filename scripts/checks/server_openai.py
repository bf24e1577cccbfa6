"""Talks to the local worker (SmolLM2-135M-Instruct + demo adapters) with the official
`openai` Python client; base URL from argv[1]."""
import os
import sys

import openai

base = sys.argv[1]
here = os.path.dirname(os.path.abspath(__file__))
c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
QUESTION = [{"role": "user", "content": "What is the capital of Italy?"}]


def sample(name):
    """PEFT + transformers' greedy answer recorded when the adapter was trained."""
    with open(os.path.join(here, "../../tests/fixtures/demo", name, "sample.txt")) as f:
        return f.read().split("greedy 20 tokens: ", 1)[1].rstrip("\n")


ids = [m.id for m in c.models.list().data]
for want in ("demo", "smollm2-135m-instruct", "french", "json"):
    assert want in ids, ids

# The adapters answer exactly as PEFT did (greedy, 20 tokens at most).
r = c.chat.completions.create(model="french", messages=QUESTION, max_tokens=20, temperature=0)
assert r.choices[0].message.content == sample("french"), r
assert r.choices[0].finish_reason == "stop", r
assert r.model_extra["mole"]["adapter"] == "french", r.model_extra

chunks = list(c.chat.completions.create(model="json", messages=QUESTION, max_tokens=20,
                                        temperature=0, stream=True,
                                        stream_options={"include_usage": True}))
text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
assert text == sample("json"), text
assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
# include_usage: the last chunk has no choices and the whole request's usage, as OpenAI's.
assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0, chunks[-1]
assert all(ch.usage is None for ch in chunks[:-1])

# The base model answers differently from both adapters.
r = c.chat.completions.create(model="smollm2-135m-instruct", messages=QUESTION, max_tokens=20, temperature=0)
base_answer = r.choices[0].message.content
assert base_answer and base_answer not in (sample("french"), sample("json")), base_answer

# Routing by keyword when the pool name is the model.
r = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Say bonjour to my friend"}], max_tokens=12, temperature=0)
assert r.model_extra["mole"]["adapter"] == "french" and r.model_extra["mole"]["route"] == "keywords", r.model_extra

# Routing by meaning (all-MiniLM-L6-v2 against the adapters' descriptions and examples).
r = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Output a structured object describing the user"}], max_tokens=12, temperature=0)
assert r.model_extra["mole"]["adapter"] == "json" and r.model_extra["mole"]["route"] == "embedding", r.model_extra
r = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "The mitochondria is the powerhouse of the cell"}], max_tokens=4)
assert r.model_extra["mole"]["adapter"] is None and r.model_extra["mole"]["route"] == "fallback", r.model_extra

# Completions, logprobs and seeds.
r = c.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=5, temperature=0)
assert r.choices[0].finish_reason in ("length", "stop") and r.usage.prompt_tokens > 0, r
r = c.chat.completions.create(model="french", messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
lp = r.choices[0].logprobs.content
assert len(lp) == r.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in lp), lp
assert all(t.logprob <= 0 for t in lp)
a, b = (c.chat.completions.create(model="json", messages=QUESTION, max_tokens=12, temperature=0.9, seed=7).choices[0].message.content for _ in range(2))
assert a == b, (a, b)
# n choices: choice i is the request of seed 7 + i, whole and streamed.
r = c.chat.completions.create(model="json", messages=QUESTION, max_tokens=12, temperature=0.9, seed=7, n=2)
alone = [c.chat.completions.create(model="json", messages=QUESTION, max_tokens=12, temperature=0.9, seed=s) for s in (7, 8)]
assert [ch.index for ch in r.choices] == [0, 1], r
assert [ch.message.content for ch in r.choices] == [x.choices[0].message.content for x in alone], (r, alone)
assert r.usage.completion_tokens == sum(x.usage.completion_tokens for x in alone), (r.usage, alone)
assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens, (r.usage, alone)
streamed = ["", ""]
for ch in c.chat.completions.create(model="json", messages=QUESTION, max_tokens=12, temperature=0.9, seed=7, n=2, stream=True):
    for choice in ch.choices:
        streamed[choice.index] += choice.delta.content or ""
assert streamed == [ch.message.content for ch in r.choices], (streamed, r)

# Errors come back as the client's typed exceptions with our codes.
try:
    c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    raise SystemExit("expected NotFoundError")
except openai.NotFoundError as e:
    assert e.code == "model_not_found", e
try:
    c.chat.completions.create(model="demo", messages=[], max_tokens=5)
    raise SystemExit("expected BadRequestError")
except openai.BadRequestError as e:
    assert e.code == "empty_messages", e
print("server_openai.py: ok (french:", repr(sample("french")), "| base:", repr(base_answer), ")")
