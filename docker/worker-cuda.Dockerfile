# mole-worker with candle's CUDA kernels, for GPU pools (`spec.gpu.count` > 0).
#   docker build -f docker/worker-cuda.Dockerfile -t ghcr.io/mole-dev/mole-worker:0.1.0-cuda .
# The kernels are compiled for one compute capability, CUDA_COMPUTE_CAP (90: Hopper, H100 and
# H200); build with --build-arg CUDA_COMPUTE_CAP=89 (Ada), 80 (A100), ... for other GPUs.
# Base images are pinned by tag and digest (docker/README.md). The runtime image's CUDA (13.0)
# needs an NVIDIA driver >= 580 on the nodes.

# The Rust toolchain comes from the official image (rustup-installed there, checksum-verified,
# the workspace's rust-version 1.89), copied into the CUDA build image below: nothing is
# downloaded by curl | sh.
FROM rust:1.89.0-bookworm@sha256:948f9b08a66e7fe01b03a98ef1c7568292e07ec2e4fe90d88c07bb14563c84ff AS rust

FROM nvidia/cuda:13.0.1-devel-ubuntu24.04@sha256:7d2f6a8c2071d911524f95061a0db363e24d27aa51ec831fcccf9e76eb72bc92 AS build
ARG CUDA_COMPUTE_CAP=90
ENV RUSTUP_HOME=/usr/local/rustup \
    CARGO_HOME=/usr/local/cargo \
    PATH=/usr/local/cargo/bin:/usr/local/cuda/bin:$PATH \
    CUDA_HOME=/usr/local/cuda \
    CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP}
COPY --from=rust /usr/local/rustup /usr/local/rustup
COPY --from=rust /usr/local/cargo /usr/local/cargo
# ca-certificates for cargo's registry; g++ (with gcc and binutils) as nvcc's host compiler, the
# linker of rustc and for strip. Not version-pinned: Ubuntu's archive keeps only the current
# version of a package, so a pin breaks the build at the next security update; the base
# image's digest pins the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates g++ \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --locked --release -p mole-worker --features cuda \
    && strip target/release/mole-worker
# mole-bench (`mole-bench decode --service-model FILE` on the pool's GPUs) in a build of its
# own: one invocation with both would unify features and put its seams in mole-worker.
RUN cargo build --locked --release -p mole-bench --features cuda \
    && strip target/release/mole-bench

# The runtime image carries what the binary links dynamically (cudarc's dynamic-linking and
# candle-kernels): libcudart, libcublas, libcublasLt, libcurand and libnvrtc (+ its builtins)
# of the same CUDA 13.0, and libstdc++. libcuda comes from the node's driver through the NVIDIA
# container runtime.
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04@sha256:c3fde347d52d578c84fd644bc177bc7ec333feaf11550d990da4084d7612e4c7
COPY --from=build /src/target/release/mole-worker /usr/local/bin/mole-worker
COPY --from=build /src/target/release/mole-bench /usr/local/bin/mole-bench
# The pods the operator creates run as 65532 (restricted profile); numeric for runAsNonRoot.
USER 65532:65532
ENTRYPOINT ["mole-worker"]
