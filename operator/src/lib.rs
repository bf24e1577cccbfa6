//! mole operator: reconciles InferencePool and Adapter into ConfigMaps, Deployments,
//! Services, PodDisruptionBudgets and merge Jobs.

#![forbid(unsafe_code)]

pub mod controller;
pub mod error;
pub mod fleet;
pub mod leader;
pub mod mergedown;
pub mod reasons;
pub mod resources;
pub mod telemetry;
