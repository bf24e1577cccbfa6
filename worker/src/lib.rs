//! mole worker
