"""Two measurements scripts/bench-llama.sh takes of a mole worker besides guidellm's.

probe URL: GETs URL/healthz every 100 ms (5 s timeout) until SIGINT or until the server has
not answered for 5 s, then prints JSON: the number of probes, the slowest, the 99th
percentile and how many took over 100 ms (issue 52: health answers within 100 ms under any
mix of requests; a probe the server does not answer in time is a pod restarted).

schema URL MODEL: a chat request constrained by a JSON schema the server has not seen (a
property named by a random token), then five more with the same schema; prints the first's
time and the median of the repeats in JSON. The first compiles the grammar, the repeats
should find it compiled (the grammar cache), so their difference is what the cache saves.
Standard library only: it runs in guidellm's virtual environment.
"""

import json
import signal
import statistics
import sys
import time
import urllib.request
import uuid


def probe(url):
    stop = False

    def on_int(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_int)
    times, last_ok = [], time.monotonic()
    while not stop and time.monotonic() - last_ok < 5:
        t = time.perf_counter()
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
                r.read()
            times.append((time.perf_counter() - t) * 1000)
            last_ok = time.monotonic()
        except OSError:
            pass
        time.sleep(0.1)
    times.sort()
    print(json.dumps({
        "probes": len(times),
        "max_ms": round(times[-1], 1) if times else None,
        "p99_ms": round(times[int(0.99 * (len(times) - 1))], 1) if times else None,
        "over_100ms": sum(t > 100 for t in times),
    }))


def schema(url, model):
    key = "k" + uuid.uuid4().hex[:12]
    body = {
        "model": model,
        "max_tokens": 8,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Describe a city as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": {
            "type": "object",
            "properties": {
                key: {"type": "string"},
                "name": {"type": "string", "maxLength": 40},
                "population": {"type": "integer", "minimum": 0},
                "districts": {"type": "array", "items": {"type": "object", "properties": {
                    "name": {"type": "string"}, "area": {"type": "number"}},
                    "required": ["name", "area"]}},
                "kind": {"enum": ["capital", "town", "village"]},
            },
            "required": [key, "name", "population", "districts", "kind"],
        }}},
    }

    def once():
        req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
        return (time.perf_counter() - t) * 1000

    first = once()
    repeats = [once() for _ in range(5)]
    print(json.dumps({"first_ms": round(first, 1), "repeat_median_ms": round(statistics.median(repeats), 1)}))


if __name__ == "__main__":
    {"probe": lambda: probe(sys.argv[2]), "schema": lambda: schema(sys.argv[2], sys.argv[3])}[sys.argv[1]]()
