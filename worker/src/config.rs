//! Loading the worker configuration (being built).
