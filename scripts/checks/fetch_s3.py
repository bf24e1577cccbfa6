"""fetch-s3.sh's checks: moto's S3 server on a free port, boto3 uploads, the real binary."""
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import boto3

binary, moto_server = sys.argv[1], sys.argv[2]

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
endpoint = f"http://127.0.0.1:{port}"
server = subprocess.Popen(
    [moto_server, "-H", "127.0.0.1", "-p", str(port)],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
)
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


try:
    for _ in range(100):
        try:
            urllib.request.urlopen(endpoint + "/", timeout=1)
            break
        except Exception:
            time.sleep(0.1)
    env = dict(
        os.environ,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
        MOLE_LOG="info",
        NO_COLOR="1",
    )
    env.pop("AWS_SESSION_TOKEN", None)
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    s3.create_bucket(Bucket="models")
    big = bytes((i * 31 + 7) % 256 for i in range(300_000))
    small = bytes((i * 17 + 3) % 256 for i in range(40_000))
    files = {
        "config.json": b'{"model_type": "llama"}',
        "model-00001-of-00002.safetensors": big,
        "model-00002-of-00002.safetensors": small,
        "tokenizer.json": b"{}",
    }
    for name, body in files.items():
        extra = {"ChecksumAlgorithm": "SHA256"} if name.startswith("model-00001") else {}
        s3.put_object(Bucket="models", Key=f"tiny/{name}", Body=body, **extra)
    s3.put_object(Bucket="models", Key="tiny/pytorch_model.bin", Body=b"\x80\x02pickle")
    s3.put_object(Bucket="models", Key="old/config.json", Body=b"{}")
    s3.put_object(Bucket="models", Key="old/pytorch_model.bin", Body=b"\x80\x02pickle")

    def fetch(source, dest, **more):
        return subprocess.run(
            [binary, "fetch", "--source", source, "--dest", dest],
            env=dict(env, **more),
            capture_output=True,
            text=True,
            timeout=120,
        )

    with tempfile.TemporaryDirectory() as tmp:
        dest = os.path.join(tmp, "tiny")
        r = fetch("s3://models/tiny", dest)
        check(r.returncode == 0, f"s3://models/tiny fetched (exit {r.returncode}) {r.stderr[-500:] if r.returncode else ''}")
        for name, body in files.items():
            path = os.path.join(dest, name)
            check(os.path.exists(path) and open(path, "rb").read() == body, f"{name} equals the object")
        check(not os.path.exists(os.path.join(dest, "pytorch_model.bin")), "the pickle beside the safetensors is skipped")
        m = json.load(open(os.path.join(dest, ".mole-fetch.json")))
        by = {f["name"]: f for f in m["files"]}
        check(m["source"] == "s3://models/tiny" and sorted(by) == sorted(files), "manifest lists the files")
        check(m["skipped"] == ["pytorch_model.bin"], f"manifest lists the skipped pickle: {m['skipped']}")
        check(all(by[n]["sha256"] == hashlib.sha256(b).hexdigest() and by[n]["size"] == len(b) for n, b in files.items()),
              "manifest sha256 and sizes are the bytes'")
        check(by["model-00001-of-00002.safetensors"]["verified"] == "sha256",
              f"object uploaded with a SHA-256 checksum verified against it: {by['model-00001-of-00002.safetensors']['verified']}")
        check(by["model-00002-of-00002.safetensors"]["verified"] == "md5",
              f"single-part object verified against its MD5 ETag: {by['model-00002-of-00002.safetensors']['verified']}")
        mtime = os.stat(os.path.join(dest, "model-00001-of-00002.safetensors")).st_mtime_ns
        r = fetch("s3://models/tiny", dest)
        check(r.returncode == 0 and "nothing to do" in r.stdout, f"a rerun is a no-op: {r.stdout.strip()}")
        check(os.stat(os.path.join(dest, "model-00001-of-00002.safetensors")).st_mtime_ns == mtime, "a rerun rewrites nothing")

        old = os.path.join(tmp, "old")
        log = os.path.join(tmp, "termination-log")
        r = fetch("s3://models/old", old, MOLE_TERMINATION_LOG=log)
        line = open(log).read().strip() if os.path.exists(log) else ""
        check(r.returncode == 2 and "pickle_refused" in r.stderr and "pytorch_model.bin" in line,
              f"pickle-only prefix refused naming the file (exit {r.returncode}): {line}")

        resumed = os.path.join(tmp, "resumed")
        os.makedirs(resumed)
        name = "model-00001-of-00002.safetensors"
        with open(os.path.join(resumed, name + ".part"), "wb") as f:
            f.write(big[:123_456])
        r = fetch("s3://models/tiny", resumed)
        check(r.returncode == 0 and "resuming with a Range request" in r.stderr and "from=123456" in r.stderr,
              "a killed run's .part is resumed with a Range request")
        check(open(os.path.join(resumed, name), "rb").read() == big, "the resumed file equals the object")
        check(not os.path.exists(os.path.join(resumed, name + ".part")), "no .part is left")

        r = fetch("s3://models/nothing-here", os.path.join(tmp, "none"))
        check(r.returncode == 1 and "not_found" in r.stderr, f"an empty prefix is not found (exit {r.returncode})")
finally:
    server.terminate()
    server.wait()

if failures:
    print(f"fetch-s3: {len(failures)} failed")
    sys.exit(1)
print("fetch-s3: all passed")
