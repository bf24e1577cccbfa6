//! import (being built).

pub mod cli;
