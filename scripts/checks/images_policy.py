"""Policy of the container images (run by scripts/checks/images.sh).

Every Dockerfile under docker/: each FROM is a pinned image (a version tag, not `latest`, and
an @sha256 digest) or an earlier stage; the runtime (last) stage runs as a numeric non-root
USER. Per image: the operator builds only mole-operator; the CUDA worker builds mole-worker
with `--features cuda` for compute capability 90 on a CUDA devel image and runs on the runtime
image of the same CUDA release; the CPU worker builds mole-worker without CUDA. The Rust images
match the workspace's rust-version, the workflow pushes each Dockerfile under the name and
tag suffix the operator and the chart default to, and .dockerignore keeps build outputs out of
the context but every workspace member's manifest and sources in.

Usage: images_policy.py REPO_ROOT            check the repository, exit 1 on a violation
       images_policy.py --dockerfile ROLE F  check one Dockerfile F as ROLE (operator,
                                             worker-cuda, worker-cpu); for the self-test
"""

import fnmatch
import re
import sys
from pathlib import Path

ROLES = {
    "operator": "docker/operator.Dockerfile",
    "worker-cuda": "docker/worker-cuda.Dockerfile",
    "worker-cpu": "docker/worker-cpu.Dockerfile",
}
# What .github/workflows/images.yml must push each Dockerfile as (the operator's and the
# chart's defaults: operator/src/resources/image.rs, charts/mole/values.yaml).
PUSHED_AS = {
    "operator": ("ghcr.io/mole-dev/mole-operator", ""),
    "worker-cuda": ("ghcr.io/mole-dev/mole-worker", "-cuda"),
    "worker-cpu": ("ghcr.io/mole-dev/mole-worker", "-cpu"),
}
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def instructions(text):
    """(keyword, arguments) of each instruction: comments dropped, continuations joined."""
    out, cur = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not cur and (not line or line.startswith("#")):
            continue
        if cur and line.startswith("#"):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        kw, _, rest = cur.strip().partition(" ")
        out.append((kw.upper(), rest.strip()))
        cur = ""
    return out


def stages(text):
    """[(base image, alias, [(keyword, args), ...]), ...] with ARG defaults substituted in FROM."""
    args, result = {}, []
    for kw, rest in instructions(text):
        if kw == "ARG" and not result:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
            continue
        if kw == "FROM":
            words = [w for w in rest.split() if not w.startswith("--platform")]
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), words[0])
            alias = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            result.append((image, alias, []))
            continue
        if result:
            result[-1][2].append((kw, rest))
    return result


def check_pinned(image, aliases, errors):
    if image in aliases:
        return
    ref = image.split("@")[0]
    name, _, tag = ref.rpartition(":") if ":" in ref.split("/")[-1] else (ref, "", "")
    if not tag:
        errors.append(f"FROM {image}: no tag")
    elif tag == "latest":
        errors.append(f"FROM {image}: the moving tag latest")
    if not DIGEST.search(image):
        errors.append(f"FROM {image}: no @sha256 digest")


def check_dockerfile(role, text, rust_version):
    errors = []
    st = stages(text)
    if not st:
        return ["no FROM"]
    aliases = set()
    for image, alias, _ in st:
        check_pinned(image, aliases, errors)
        if alias:
            aliases.add(alias)
    runtime_image, _, runtime = st[-1]
    users = [rest for kw, rest in runtime if kw == "USER"]
    if not users:
        errors.append("runtime stage sets no USER")
    else:
        m = re.fullmatch(r"(\d+)(?::(\d+))?", users[-1])
        if not m:
            errors.append(f"runtime USER {users[-1]!r} is not numeric (uid[:gid])")
        elif int(m.group(1)) == 0:
            errors.append("runtime USER is root (uid 0)")
    binary = "mole-operator" if role == "operator" else "mole-worker"
    entry = [rest for kw, rest in runtime if kw == "ENTRYPOINT"]
    if not entry or entry[-1].replace(" ", "") != f'["{binary}"]':
        errors.append(f'runtime ENTRYPOINT is not ["{binary}"]')
    runs = [rest for _, _, ins in st for kw, rest in ins if kw == "RUN"]
    builds = [r for r in runs if "cargo build" in r or "cargo install" in r]
    if not builds:
        errors.append("no cargo build")
    everything = "\n".join(rest for _, _, ins in st for _, rest in ins)
    if role == "operator":
        for b in builds:
            if "-p mole-operator" not in b or re.search(r"--workspace|--all\b", b):
                errors.append(f"operator image builds more than mole-operator: {b!r}")
        if "mole-worker" in everything or "--features cuda" in everything:
            errors.append("operator image builds or copies the worker")
    else:
        # mole-worker, and mole-bench beside it in a build of its own: one invocation with
        # both would unify features and turn mole-bench's seams on in mole-worker.
        for b in builds:
            pkgs = re.findall(r"-p\s+(\S+)", b)
            if pkgs not in (["mole-worker"], ["mole-bench"]):
                errors.append(f"worker image build is not -p mole-worker or -p mole-bench alone: {b!r}")
        if not any(re.findall(r"-p\s+(\S+)", b) == ["mole-worker"] for b in builds):
            errors.append("worker image does not build -p mole-worker")
        if role == "worker-cuda" and any("--features cuda" not in b for b in builds):
            errors.append("a CUDA worker image build lacks --features cuda")
        cuda = [b for b in builds if "--features cuda" in b]
        if role == "worker-cuda":
            if not cuda:
                errors.append("CUDA worker is not built with --features cuda")
            # The compute capability in effect where cargo runs: an ARG default passed on by
            # ENV, or an ENV, or set on the RUN line itself.
            cap = None
            for _, _, ins in st:
                for kw, rest in ins:
                    for m in re.finditer(r"CUDA_COMPUTE_CAP=(\S+)", rest):
                        if kw in ("ARG", "ENV", "RUN") and not m.group(1).startswith("$"):
                            cap = m.group(1)
            if cap != "90":
                errors.append(f"CUDA worker is built for compute capability {cap}, not 90")
            devel = [i for i, _, _ in st if re.match(r"(nvcr\.io/)?nvidia/cuda:[\d.]+-devel-", i)]
            if not devel:
                errors.append("CUDA worker is not built on an nvidia/cuda devel image")
            m = re.match(r"(nvcr\.io/)?nvidia/cuda:([\d.]+)-runtime-ubuntu", runtime_image)
            if not m:
                errors.append(f"CUDA worker runs on {runtime_image}, not an nvidia/cuda runtime image")
            elif devel and f":{m.group(2)}-devel-" not in devel[0]:
                errors.append(f"CUDA runtime {m.group(2)} differs from the build's {devel[0]}")
        elif cuda or "nvidia/cuda" in everything + runtime_image:
            errors.append("CPU worker is built with CUDA")
    for image, _, _ in st:
        m = re.match(r"(docker\.io/)?(library/)?rust:(\d+\.\d+)(\.\d+)?-", image)
        if m and rust_version and m.group(3) != rust_version:
            errors.append(f"{image}: Rust {m.group(3)}, the workspace needs {rust_version}")
    return errors


def check_workflow(root, errors):
    wf = root / ".github/workflows/images.yml"
    if not wf.exists():
        errors.append(f"{wf}: missing")
        return
    text = wf.read_text()
    if not re.search(r"tags:\s*\[\s*\"v\*\"\s*\]", text):
        errors.append("images.yml: not triggered by v* tags")
    for m in re.finditer(r"uses:\s*(\S+)", text):
        if not re.search(r"@[0-9a-f]{40}$", m.group(1)):
            errors.append(f"images.yml: action {m.group(1)} is not pinned by commit")
    for role, (image, suffix) in PUSHED_AS.items():
        block = re.search(
            r"dockerfile:\s*" + re.escape(ROLES[role]) + r"\s+image:\s*(\S+)\s+suffix:\s*\"([^\"]*)\"",
            text,
        )
        if not block:
            errors.append(f"images.yml: {ROLES[role]} is not built")
        elif (block.group(1), block.group(2)) != (image, suffix):
            errors.append(f"images.yml: {ROLES[role]} pushed as {block.group(1)}:<v>{block.group(2)}, "
                          f"the defaults say {image}:<v>{suffix}")


def main():
    if sys.argv[1] == "--dockerfile":
        role, path = sys.argv[2], Path(sys.argv[3])
        errors = check_dockerfile(role, path.read_text(), None)
        for e in errors:
            print(f"{path}: {e}", file=sys.stderr)
        sys.exit(1 if errors else 0)
    root = Path(sys.argv[1])
    cargo = (root / "Cargo.toml").read_text()
    rust_version = re.search(r'^rust-version\s*=\s*"([^"]+)"', cargo, re.M).group(1)
    version = re.search(r'\[workspace\.package\][^\[]*?^version\s*=\s*"([^"]+)"', cargo, re.M | re.S).group(1)
    app = re.search(r'^appVersion:\s*"?([^"\s]+)"?', (root / "charts/mole/Chart.yaml").read_text(), re.M).group(1)
    errors = []
    if app != version:
        errors.append(f"chart appVersion {app} != workspace version {version}: the chart's and the "
                      "operator's default worker tags would differ")
    found = sorted(str(p.relative_to(root)) for p in (root / "docker").glob("*Dockerfile"))
    if root.joinpath("Dockerfile").exists():
        found.append("Dockerfile")
    for extra in set(found) - set(ROLES.values()):
        errors.append(f"{extra}: a Dockerfile with no role in this policy")
    for role, rel in ROLES.items():
        path = root / rel
        if not path.exists():
            errors.append(f"{rel}: missing")
            continue
        errors += [f"{rel}: {e}" for e in check_dockerfile(role, path.read_text(), rust_version)]
    check_workflow(root, errors)
    ignore = (root / ".dockerignore")
    lines = [l.strip() for l in (ignore.read_text() if ignore.exists() else "").splitlines()]
    lines = [l for l in lines if l and not l.startswith("#")]
    for must in ("target", ".git", ".gpu", "tests/fixtures"):
        if must not in lines:
            errors.append(f".dockerignore does not keep {must} out of the build context")
    # What `cargo build --locked -p ...` needs: every workspace member's manifest and sources.
    members = re.search(r"members\s*=\s*\[([^\]]*)\]", cargo).group(1)
    needed = ["Cargo.toml", "Cargo.lock"]
    for m in re.findall(r'"([^"]+)"', members):
        needed += [f"{m}/Cargo.toml", f"{m}/src"]
    for pattern in lines:
        for path in needed:
            if fnmatch.fnmatch(path, pattern) or path.startswith(pattern.rstrip("/") + "/"):
                errors.append(f".dockerignore pattern {pattern} drops {path}, which the build needs")
    for e in errors:
        print(e, file=sys.stderr)
    if not errors:
        print(f"image policy: {len(ROLES)} Dockerfiles pinned, non-root, built as their role; "
              f"workflow and chart agree on version {version}")
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
