# mole-worker for CPU pools (`spec.gpu.count: 0`) and the merge and cleanup Jobs the operator
# runs by default: candle's CPU kernels only (no BLAS library, no CUDA).
#   docker build -f docker/worker-cpu.Dockerfile -t ghcr.io/mole-dev/mole-worker:0.1.0-cpu .
# Base images are pinned by tag and digest (docker/README.md).
FROM rust:1.89.0-bookworm@sha256:948f9b08a66e7fe01b03a98ef1c7568292e07ec2e4fe90d88c07bb14563c84ff AS build
WORKDIR /src
COPY . .
# Portable x86-64 code: the worker picks AVX2/AVX-512 kernels at run time where the node has them.
RUN cargo build --locked --release -p mole-worker \
    && strip target/release/mole-worker
# mole-bench (`mole-bench decode --service-model FILE` on the pool's nodes) in a build of its
# own: one invocation with both would unify features and put its seams in mole-worker.
RUN cargo build --locked --release -p mole-bench \
    && strip target/release/mole-bench

# The binary needs glibc (libc, libm) and libgcc_s only (`readelf -d`): rustls, pure-Rust
# tokenizer, image decoders and matmul kernels. Distroless cc carries exactly these.
FROM gcr.io/distroless/cc-debian12:nonroot@sha256:9dac0a79194e45a7da0158a9c6da57b217585af0786db3845d1f0ec1a0dd182f
COPY --from=build /src/target/release/mole-worker /usr/local/bin/mole-worker
COPY --from=build /src/target/release/mole-bench /usr/local/bin/mole-bench
# The pods the operator creates run as 65532 (restricted profile); numeric for runAsNonRoot.
USER 65532:65532
ENTRYPOINT ["mole-worker"]
