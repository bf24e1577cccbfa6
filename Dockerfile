# One image with both binaries: mole-operator (the chart) and mole-worker (pools, merge Jobs).
FROM rust:1.89-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release -p mole-operator -p mole-worker

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/mole-operator /usr/local/bin/mole-operator
COPY --from=build /src/target/release/mole-worker /usr/local/bin/mole-worker
USER 65532:65532
ENTRYPOINT ["mole-operator"]
