//! Cross-crate and end-to-end tests for mole live in `tests/tests/`.

#![forbid(unsafe_code)]
