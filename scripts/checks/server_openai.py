"""Talks to a running worker with the official `openai` Python client (base URL from argv[1]).

Checks chat (plain and streaming), completions, model listing and that API errors surface as
the client's typed exceptions with our codes.
"""
import sys

import openai

base = sys.argv[1]
c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")

ids = [m.id for m in c.models.list().data]
assert "demo" in ids and "fr" in ids, ids

r = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "bonjour x"}], max_tokens=8, seed=1)
assert r.choices[0].message.content == "[fr] bonjour x", r
assert r.choices[0].finish_reason == "stop"
assert r.usage.completion_tokens == 3, r.usage

chunks = list(c.chat.completions.create(model="js", messages=[{"role": "user", "content": "a b"}], stream=True))
text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
assert text == "[js] a b", text
assert chunks[-1].choices[0].finish_reason == "stop"

r = c.completions.create(model="smol", prompt="p q", max_tokens=2)
assert r.choices[0].text == "[] p" and r.choices[0].finish_reason == "length", r

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
print("server_openai.py: ok")
