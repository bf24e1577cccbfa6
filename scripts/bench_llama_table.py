"""Reads scripts/bench-llama.sh's guidellm JSON outputs and prints its markdown table.

Per contender and concurrency: the median time to first token and the mean output tokens per
second over the successful requests, as guidellm reports them; then each mole contender's
ratios to llama.cpp with its prompt cache on (llama.cpp's default), out tok/s as mole over
llama.cpp (goal >= 1) and time to first token as mole over llama.cpp (goal <= 1.2 for a GGUF).
Fails when a contender had errored or incomplete requests, or answered another number of
output tokens than asked (both servers must generate exactly as many), so a table never hides
them. Usage: bench_llama_table.py OUT_DIR OUTPUT_TOKENS CONTENDER...
"""

import json
import sys
from pathlib import Path

NAMES = {
    "llama-cache": "llama.cpp, prompt cache on (default)",
    "llama-nocache": "llama.cpp, prompt cache off",
    "mole-gguf": "mole, same GGUF",
    "mole-gguf-lora": "mole, same GGUF + LoRA",
    "mole-bf16": "mole, bf16 import",
    "mole-bf16-kv32": "mole, bf16 import, f32 KV cache (kvCacheDtype: f32)",
    "mole-bf16-before": "mole, bf16 import, MOLE_BEFORE_BIN's worker",
}


def streams_of(bench):
    strategy = bench["config"]["strategy"]
    for key in ("streams", "max_concurrency", "concurrency"):
        if key in strategy:
            return int(strategy[key])
    raise KeyError(f"no concurrency in the strategy {strategy}")


def read(out, contender):
    """Every level's run of `contender`: one file per level (`<contender>-<streams>.json`)."""
    rows = {}
    whole = out / f"{contender}.json"  # one run over every level
    if whole.exists():
        rows.update(read_file(whole))
    for path in sorted(out.glob(f"{contender}-*.json")):
        if path.stem[len(contender) + 1 :].isdigit():
            rows.update(read_file(path))
    if not rows:
        raise SystemExit(f"no guidellm output for {contender} in {out}")
    return rows


def read_file(path):
    rows = {}
    for bench in json.loads(path.read_text())["benchmarks"]:
        metrics = bench["metrics"]
        totals = metrics["request_totals"]
        if totals.get("errored") or totals.get("incomplete"):
            raise SystemExit(f"{path.name}: errored or incomplete requests: {totals}")
        counts = {r["output_tokens"] for r in bench["requests"]["successful"]}
        if counts != {OUTPUT}:
            raise SystemExit(f"{path.name}: output tokens per request {counts}, asked {OUTPUT}")
        ttft = metrics["time_to_first_token_ms"]["successful"]["median"]
        tps = metrics["output_tokens_per_second"]["successful"]["mean"]
        rows[streams_of(bench)] = (ttft, tps, totals["successful"])
    return rows


OUTPUT = 0


def main():
    global OUTPUT
    out = Path(sys.argv[1])
    OUTPUT = int(sys.argv[2])
    contenders = sys.argv[3:]
    data = {c: read(out, c) for c in contenders}
    levels = sorted({s for rows in data.values() for s in rows})
    print("| contender | " + " | ".join(f"concurrency {s}: TTFT / out tok/s" for s in levels) + " |")
    print("|---|" + "---|" * len(levels))
    for c in contenders:
        cells = []
        for s in levels:
            ttft, tps, _ = data[c].get(s, (float("nan"), float("nan"), 0))
            cells.append(f"{ttft:,.0f} ms / {tps:.1f}")
        print(f"| {NAMES.get(c, c)} | " + " | ".join(cells) + " |")
    extras(out, contenders, data, levels)
    base = data.get("llama-cache")
    if base is None:
        return
    for c in contenders:
        if not c.startswith("mole"):
            continue
        cells = []
        for s in levels:
            if s in data[c] and s in base:
                cells.append(
                    f"{data[c][s][1] / base[s][1]:.2f}x tok/s, {data[c][s][0] / base[s][0]:.2f}x TTFT"
                )
            else:
                cells.append("-")
        print(f"| {NAMES.get(c, c)} / llama.cpp (cache on) | " + " | ".join(cells) + " |")


def extras(out, contenders, data, levels):
    """bench_prepare.py's figures per mole contender, and this build over MOLE_BEFORE_BIN's."""
    rows = []
    for c in contenders:
        h, sc = out / f"{c}.healthz.json", out / f"{c}.schema.json"
        if h.exists() and sc.exists() and h.stat().st_size and sc.stat().st_size:
            h, sc = json.loads(h.read_text()), json.loads(sc.read_text())
            rows.append(f"| {NAMES.get(c, c)} | {h['max_ms']} ms ({h['over_100ms']} of {h['probes']} over 100 ms) "
                        f"| {sc['first_ms']:.0f} ms | {sc['repeat_median_ms']:.0f} ms |")
    if rows:
        print("\n| contender | /healthz during the runs: slowest | a new JSON schema | the same again (median of 5) |")
        print("|---|---|---|---|")
        print("\n".join(rows))
    if "mole-bf16" in data and "mole-bf16-before" in data:
        new, old = data["mole-bf16"], data["mole-bf16-before"]
        cells = [f"{new[s][1] / old[s][1]:.3f}x tok/s, {new[s][0] / old[s][0]:.3f}x TTFT"
                 if s in new and s in old else "-" for s in levels]
        print("\n| ratio | " + " | ".join(f"concurrency {s}" for s in levels) + " |")
        print("|---|" + "---|" * len(levels))
        print("| this build / MOLE_BEFORE_BIN's | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
