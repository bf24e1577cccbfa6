//! merge (being built).

pub mod cli;
