//! Cross-crate and end-to-end tests for mole live in `tests/tests/`; the harnesses they share
//! (a real Kubernetes control plane on loopback, and a kubelet that runs its pods as local
//! processes) live here, with mole installed on them as a user installs it ([`stack`]).

// One unsafe call in all of it, allowed where it is: `setns` (see `kubelet::net`).
#![deny(unsafe_code)]

pub mod cluster;
pub mod kubelet;
pub mod stack;
