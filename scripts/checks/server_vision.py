"""Sends screenshots to a worker serving the tiny Qwen3-VL (tests/fixtures/vision) with the
official `openai` client and plain HTTP; base URL argv[1], fixture directory argv[2]."""
import base64
import json
import os
import sys
import urllib.request

import openai

base, fx = sys.argv[1], sys.argv[2]
ref = json.load(open(os.path.join(fx, "chat_reference.json")))["infer_one_image"]
png = open(os.path.join(fx, "images", "square.png"), "rb").read()
b64 = base64.b64encode(png).decode()
QUESTION = "What is on the screen?"
c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")

# The openai client's image_url part (a data URL), adapter by name.
r = c.chat.completions.create(
    model="screens", temperature=0, max_tokens=8, extra_body={"ignore_eos": True},
    messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
        {"type": "text", "text": QUESTION}]}])
assert r.usage.prompt_tokens == len(ref["ids"]), (r.usage, len(ref["ids"]))
assert r.usage.completion_tokens == 8, r.usage
assert r.model_extra["mole"]["adapter"] == "screens", r.model_extra
chat_text = r.choices[0].message.content

# The seeds' call: bare base64 and the router's integer label; the same answer.
req = urllib.request.Request(
    f"{base}/infer", method="POST", headers={"content-type": "application/json"},
    data=json.dumps({"prompt": QUESTION, "image_b64": b64, "expert": 1, "max_tokens": 8,
                     "temperature": 0, "ignore_eos": True}).encode())
v = json.load(urllib.request.urlopen(req))
assert v["routed_adapter"] == "screens" and v["route"] == "explicit", v
assert v["task_output"] == chat_text, (v, chat_text)
assert v["usage"]["prompt_tokens"] == len(ref["ids"]), v

# A streamed answer carries the same text.
chunks = c.chat.completions.create(
    model="screens", temperature=0, max_tokens=8, stream=True, extra_body={"ignore_eos": True},
    messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
        {"type": "text", "text": QUESTION}]}])
assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == chat_text

# Bad images are typed 400s, and the server keeps serving.
for url, code in [(f"data:image/png;base64,{b64[:len(b64) // 2]}", "invalid_image"),
                  ("https://example.com/a.png", "image_url_not_allowed"),
                  ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", "unsupported_image_format")]:
    try:
        c.chat.completions.create(model="screens", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
        raise AssertionError(f"{url[:40]} was accepted")
    except openai.BadRequestError as e:
        assert e.code == code, (e.code, code, e)
r = c.chat.completions.create(model="qwen3-vl-tiny", max_tokens=2, messages=[
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
                                 {"type": "text", "text": "hi"}]}])
assert r.choices[0].finish_reason in ("length", "stop"), r
print("server_vision.py: ok")
