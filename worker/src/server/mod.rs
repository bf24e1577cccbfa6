//! server (being built).

pub mod cli;
