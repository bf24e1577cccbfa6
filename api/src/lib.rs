//! The contract between the mole operator and the mole worker, with no Kubernetes types so the
//! worker builds without them:
//!
//! - [`WorkerConfig`]: what the operator renders into a pool's ConfigMap and the worker reads
//!   (also the format of `config/local.yaml`);
//! - [`RouterSpec`] and [`EngineLimits`]: the settings the `InferencePool` CRD embeds as
//!   `spec.router` and `spec.dynamic`, copied as they are into the WorkerConfig, with one set
//!   of defaults and one set of [`bounds`] both sides check;
//! - [`LoraAdaptersResponse`]: what the worker serves at `GET /v1/lora_adapters` and the
//!   operator reads to decide readiness;
//! - [`ModelSource`]: the `hf://`, `s3://` and `pvc://` URIs of models and adapters, parsed
//!   by the operator's validation and the worker's `fetch` alike;
//! - [`request`]: the bounds of a generation request's fields, which the worker's validation
//!   checks and its OpenAPI document states;
//! - the enums both sides name ([`Dtype`], [`ServingMode`], ...).

#![forbid(unsafe_code)]

pub mod bounds;
mod config;
mod enums;
mod limits;
mod listing;
pub mod request;
mod router;
mod service_model;
mod source;

pub use bounds::BoundsError;
pub use config::{
    canary_pick, session_bucket, MergedModel, RoutingSignals, WorkerAdapter, WorkerAuth,
    WorkerBaseModel, WorkerCanary, WorkerConfig, SESSION_HEADER,
};
pub use enums::{
    Dtype, ImageProcessor, ReasoningParser, RouterFallback, RouterStrategy, ServingMode,
    ToolCallParser, UnknownName, WorkerMode,
};
pub use limits::{EngineLimits, GuideParserLimits, PrefixCacheScope, WorkerLimits};
pub use listing::{
    AdapterCounters, LoraAdapterInfo, LoraAdaptersResponse, Residency, ResidencyReport,
    ResidentAdapter, LATENCY_BUCKETS_MS,
};
pub use router::RouterSpec;
pub use service_model::{ServiceModel, ServiceModelError};
pub use source::{ModelSource, SourceError};
