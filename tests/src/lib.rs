//! Cross-crate and end-to-end tests for mole live in `tests/tests/`; the harnesses they share
//! (a real Kubernetes control plane on loopback) live here.

#![forbid(unsafe_code)]

pub mod cluster;
