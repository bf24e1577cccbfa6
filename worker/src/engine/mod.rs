//! The inference engine: an engine thread with a continuous-batching scheduler over one
//! model instance and a registry of LoRA adapters. The server talks to it only through
//! [`api`].

pub mod api;
