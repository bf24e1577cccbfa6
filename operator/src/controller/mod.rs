//! Controllers: each a pipeline observe → validate → build → apply → status.

pub mod validate;
