//! mole operator library.

pub mod mergedown;
