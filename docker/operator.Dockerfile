# mole-operator: the controllers the Helm chart runs. Builds only the operator crate (and
# mole-crds, mole-api under it): no candle, no worker, so the image is a few MiB on distroless.
#   docker build -f docker/operator.Dockerfile -t ghcr.io/mole-dev/mole-operator:0.1.0 .
# Base images are pinned by tag and digest (see docker/README.md for where the digests come
# from and how to bump them).
FROM rust:1.89.0-bookworm@sha256:948f9b08a66e7fe01b03a98ef1c7568292e07ec2e4fe90d88c07bb14563c84ff AS build
WORKDIR /src
COPY . .
RUN cargo build --locked --release -p mole-operator \
    && strip target/release/mole-operator

# Only glibc and libgcc are needed (rustls, no OpenSSL); distroless has no shell either.
FROM gcr.io/distroless/cc-debian12:nonroot@sha256:9dac0a79194e45a7da0158a9c6da57b217585af0786db3845d1f0ec1a0dd182f
COPY --from=build /src/target/release/mole-operator /usr/local/bin/mole-operator
# The chart's securityContext runs as 65532 too; numeric so runAsNonRoot can check it.
USER 65532:65532
ENTRYPOINT ["mole-operator"]
