"""Bodies whose verdict the document and the server must agree on (run by openapi.sh).

schemathesis draws its bodies at random, so a disagreement it found once may not be drawn by
the next seed. These are the ones found so far, kept: for each, the OpenAPI document's own
verdict (the request body's schema, validated with `jsonschema` as schemathesis does) and the
server's answer must agree — valid bodies answered 2xx (or 404/429, which the document allows
for any body), invalid ones refused with a 4xx. argv[1]: the worker's URL; argv[2] (optional):
an API key.
"""
import json
import sys
import urllib.error
import urllib.request

import jsonschema

url = sys.argv[1]
key = sys.argv[2] if len(sys.argv) > 2 else None


def call(method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method)
    req.add_header("content-type", "application/json")
    if key:
        req.add_header("authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


status, raw = call("GET", "/openapi.json")
assert status == 200, status
doc = json.loads(raw)


def body_schema(path):
    s = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return {**s, "components": doc["components"]}


def chat(**extra):
    return {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **extra}


def completion(**extra):
    return {"max_tokens": 2, "prompt": "hi", **extra}


# A 2x2 PNG.
IMAGE = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAEElEQVR4nGM4IScHRAwQCgAfJgQRoo8irwAAAABJRU5ErkJggg=="
)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CASES = [
    # Found by schemathesis (issue 52): called valid, refused.
    ("/v1/chat/completions", "an empty guided_grammar", chat(guided_grammar="")),
    ("/v1/chat/completions", "tool_choice without tools", chat(tool_choice="auto")),
    ("/v1/chat/completions", "tool_choice required without tools", chat(tool_choice="required")),
    ("/v1/chat/completions", "two guides", chat(guided_regex="a", guided_choice=["a"])),
    ("/v1/completions", "two guides", completion(guided_regex="a", guided_choice=["a"])),
    (
        "/v1/chat/completions",
        "response_format and a guide",
        chat(response_format={"type": "json_object"}, guided_choice=["a"]),
    ),
    (
        "/v1/chat/completions",
        "two guides in structured_outputs",
        chat(structured_outputs={"regex": "a", "choice": ["a"]}),
    ),
    ("/v1/chat/completions", "structured_outputs without a constraint", chat(structured_outputs={})),
    ("/v1/chat/completions", "structured_outputs json_object false", chat(structured_outputs={"json_object": False})),
    ("/infer", "a streamed task", {"prompt": "hi", "max_tokens": 2, "stream": True}),
    ("/infer", "a task of two choices", {"prompt": "hi", "max_tokens": 2, "n": 2}),
    ("/infer", "a task by input", {"input": "hi", "max_tokens": 2}),
    ("/infer", "a task without a prompt", {"max_tokens": 2}),
    ("/v1/responses", "an unknown item type", {"input": [{"type": "web_search_call", "id": "w"}], "max_output_tokens": 2}),
    ("/v1/responses", "an empty input", {"input": [], "max_output_tokens": 2}),
    ("/v1/responses", "tool_choice without tools", {"input": "x", "tool_choice": "required", "max_output_tokens": 2}),
    ("/v1/responses", "previous_response_id", {"input": "x", "previous_response_id": "resp_1", "max_output_tokens": 2}),
    ("/v1/responses", "a chat field", {"input": "x", "max_tokens": 2}),
    # Found by schemathesis (seed 976522811, /v1/route): an image part's `text` is read as a
    # string whatever the part's type, so an object there is refused; the document must say so.
    ("/v1/chat/completions", "an image part with an object as text", chat(messages=[
        {"role": "user", "content": [{"type": "input_image", "image_url": IMAGE, "text": {"a": None}}]}])),
    ("/v1/route", "an image part with an object as text", {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}, "text": {}}]}]}),
    # The image placeholder as a completion's token id (tests/fixtures/vision/qwen3_vl's is
    # 250): a prompt with no image for it.
    ("/v1/completions", "the image placeholder as a token id", completion(prompt=[1, 250])),
    # Their neighbours, which must stay as they are.
    ("/v1/chat/completions", "tool_choice none without tools", chat(tool_choice="none")),
    ("/v1/chat/completions", "one guide", chat(guided_choice=["a", "b"])),
    ("/v1/chat/completions", "text format and a guide", chat(response_format={"type": "text"}, guided_choice=["a"])),
    ("/v1/chat/completions", "json_object null and a guide", chat(structured_outputs={"json_object": None, "choice": ["a"]})),
    ("/v1/chat/completions", "a tool named by tool_choice", chat(tools=[TOOL], tool_choice="none")),
    ("/v1/chat/completions", "a tool with an empty name", chat(tools=[{"type": "function", "function": {"name": ""}}])),
    ("/v1/chat/completions", "an unknown field", chat(temprature=0.5)),
    ("/v1/chat/completions", "logprobs as a count", chat(logprobs=2)),
    ("/v1/completions", "logprobs as a switch", completion(logprobs=True)),
    ("/v1/completions", "token ids", completion(prompt=[1, 249])),
    ("/v1/chat/completions", "an image part with a text", chat(messages=[
        {"role": "user", "content": [{"type": "input_image", "image_url": IMAGE, "text": "ignored"}]}])),
    ("/v1/route", "an image part with a null text", {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}, "text": None}]}]}),
    ("/v1/responses", "a text", {"input": "hi", "instructions": "be brief", "max_output_tokens": 2}),
    ("/v1/responses", "a tool loop's items", {"max_output_tokens": 2, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "x"}]}),
]

disagree = []
for path, what, body in CASES:
    if path not in doc["paths"]:
        disagree.append(f"{path} is not in the document")
        continue
    valid = jsonschema.Draft202012Validator(body_schema(path)).is_valid(body)
    status, raw = call("POST", path, body)
    answered = status < 400 or status in (404, 429)
    if valid != answered:
        said = "valid" if valid else "invalid"
        disagree.append(f"{path} {what}: the document calls it {said}, the server answered {status} {raw[:200]!r}")

if disagree:
    print("openapi_drift: the document and the server disagree:")
    for d in disagree:
        print("  " + d)
    sys.exit(1)
print(f"openapi_drift: the document and the server agree on {len(CASES)} bodies")
