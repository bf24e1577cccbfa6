//! Prometheus metrics of the worker (being built).
