"""schemathesis hooks for scripts/checks/openapi.sh (loaded through SCHEMATHESIS_HOOKS).

The document says an image is a `data:` URL, base64 or an http(s) URL; that its bytes decode
to an image of a format the worker reads is beyond a JSON schema. So in positive cases only
(data the document calls valid, which must be answered 2xx), every image this generator wrote
is replaced by a real 2x2 PNG, as a client would send one. Negative cases are sent as
generated. Likewise the document states that a request takes at most `limits.maxImages`
images in all its messages, a count JSON Schema cannot make across arrays: a positive case's
images past that many become empty text parts (MOLE_OPENAPI_MAX_IMAGES, the config's value,
kept at 2 so that the images' tokens leave room in the tiny model's 512-token context: how many
tokens a prompt takes is a limit the document states but cannot check).
For the same reason a positive chat keeps its first 4 messages with at most 48 characters of
text each (a random string of 48 characters is at most ~200 byte-level tokens). And a path to
load an adapter from must hold one: it becomes MOLE_OPENAPI_ADAPTER, a copy of
the fixture adapter that no configured adapter uses.
What shapes an answer (response_format, structured_outputs, guided_*, tools, tool_choice) is
valid only when its schema, regex or Lark grammar compiles, when one request carries at most
one of them, and when a named tool_choice names a tool sent: rules a JSON schema cannot state.
A positive case keeps guided_choice (any non-empty list of strings compiles) and drops the
others; engine_structured and scripts/checks/structured-outputs.sh send valid ones. Likewise a
tool call of the history carries its arguments as a JSON object's text (the document says
`contentMediaType: application/json`, which JSON Schema does not check): a positive case's
become `{}`. The Responses API's input items are held to the same: their texts cut, their
images real, a function_call's arguments `{}`, and a function_call_output kept only when it
answers a function_call before it (a reference a schema cannot state)."""

import base64
import os
import struct
import zlib

import schemathesis


def _png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    raw = b"".join(b"\x00" + bytes([200, 30, 30] * 2) for _ in range(2))
    ihdr = struct.pack(">IIBBBBB", 2, 2, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


B64 = base64.b64encode(_png()).decode()
URL = "data:image/png;base64," + B64


MAX_IMAGES = int(os.environ.get("MOLE_OPENAPI_MAX_IMAGES", "8"))


def _images(v, seen):
    """Replaces the images of messages, in place; past MAX_IMAGES, by empty text parts."""
    if isinstance(v, dict):
        if v.get("type") in ("image_url", "input_image") and "image_url" in v:
            seen[0] += 1
            if seen[0] > MAX_IMAGES:
                v.clear()
                v.update({"type": "input_text", "text": ""})
                return
            v["image_url"] = {"url": URL} if isinstance(v["image_url"], dict) else URL
        for x in v.values():
            _images(x, seen)
    elif isinstance(v, list):
        for x in v:
            _images(x, seen)


def _responses(body):
    """A Responses API body's input, as `before_call` holds chats (see the module's doc)."""
    if isinstance(body.get("instructions"), str):
        body["instructions"] = body["instructions"][:48]
    items = body.get("input")
    if isinstance(items, str):
        body["input"] = items[:48]
        return
    if not isinstance(items, list):
        return
    del items[4:]
    calls = set()
    kept = []
    for it in items:
        if not isinstance(it, dict):
            kept.append(it)
            continue
        kind = it.get("type")
        if kind == "function_call":
            it["arguments"] = "{}"
            calls.add(it.get("call_id"))
        if kind == "function_call_output" and it.get("call_id") not in calls:
            continue
        for k in ("content", "output", "summary"):
            v = it.get(k)
            if isinstance(v, str):
                it[k] = v[:48]
            elif isinstance(v, list):
                del v[4:]
                for p in v:
                    for t in ("text", "refusal"):
                        if isinstance(p, dict) and isinstance(p.get(t), str):
                            p[t] = p[t][:48]
        kept.append(it)
    if not kept:
        kept = [{"role": "user", "content": ""}]
    items[:] = kept
    _images(items, [0])


@schemathesis.hook
def before_call(context, case, kwargs):
    meta = getattr(case, "meta", None)
    if meta is None or not meta.generation.mode.is_positive:
        return
    body = case.body
    if not isinstance(body, dict):
        return
    msgs = body.get("messages")
    if isinstance(msgs, list):
        del msgs[4:]
        for m in msgs:
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                m["content"] = m["content"][:48]
            elif isinstance(m, dict) and isinstance(m.get("content"), list):
                del m["content"][4:]
                for p in m["content"]:
                    if isinstance(p, dict) and isinstance(p.get("text"), str):
                        p["text"] = p["text"][:48]
    _images(msgs, [0])
    if isinstance(msgs, list):
        for m in msgs:
            calls = m.get("tool_calls") if isinstance(m, dict) else None
            for c in calls if isinstance(calls, list) else []:
                f = c.get("function") if isinstance(c, dict) else None
                if isinstance(f, dict) and isinstance(f.get("arguments"), str):
                    f["arguments"] = "{}"
    _responses(body)
    if isinstance(body.get("image_b64"), str):
        body["image_b64"] = B64
    for k in ("response_format", "structured_outputs", "guided_json", "guided_regex",
              "guided_grammar", "tools", "tool_choice", "parallel_tool_calls", "text"):
        body.pop(k, None)
    # An adapter to load: a directory of one, as an operator would name it.
    if isinstance(body.get("lora_path"), str) and os.environ.get("MOLE_OPENAPI_ADAPTER"):
        body["lora_path"] = os.environ["MOLE_OPENAPI_ADAPTER"]
