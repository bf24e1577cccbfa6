//! The operator's and the admin's endpoints: the adapter listing, loading and unloading
//! adapters, reloading the config file.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::extract::{OptionalTyped, Typed};
use super::reply_bodies::{LoraAnswer, ReloadApplying};
use super::request_bodies::{LoadBody, ReloadBody};
use super::S;
use crate::error::bad;
use crate::error::Refusals;
use crate::ApiError;

/// How long `POST /admin/reload` waits for the adapters to load before answering 202.
const RELOAD_ANSWER_WITHIN: Duration = Duration::from_secs(2);

/// `GET /v1/lora_adapters` (API key, or the operator or admin token): every version, loaded
/// or refused with the reason.
#[utoipa::path(get, path = "/v1/lora_adapters", tag = "admin",
    responses((status = 200, description = "Every adapter version, loaded or refused with the reason", body = mole_api::LoraAdaptersResponse), Refusals),
    security(("bearer" = [])))]
pub async fn lora_adapters(State(s): S) -> Json<mole_api::LoraAdaptersResponse> {
    Json(mole_api::LoraAdaptersResponse {
        object: "list".into(),
        base_model: s.cfg().base_model.name.clone(),
        data: s.adapter_listing(),
        traffic: s.admin.adapter_counters(),
    })
}

/// `POST /v1/load_lora_adapter` (vLLM shape). Admin only; path confined to the model root;
/// safetensors weights only (pickle `.bin` files can run code).
#[utoipa::path(post, path = "/v1/load_lora_adapter", tag = "admin",
    request_body = LoadBody,
    responses((status = 200, description = "Loaded", body = LoraAnswer), Refusals),
    security(("bearer" = [])))]
pub async fn load_lora(
    State(s): S,
    Typed(b): Typed<LoadBody>,
) -> Result<Json<LoraAnswer>, ApiError> {
    let Some(p) = b.lora_path else {
        return Err(bad("invalid_request", "lora_path is required"));
    };
    let cfg = s.cfg();
    // The configured adapters' rule: a name the API takes is one a config could hold.
    crate::config::check_adapter_name(&cfg, &b.lora_name)
        .map_err(|e| bad("invalid_adapter_name", e))?;
    let path = crate::config::resolve_in_root(&cfg.model_root, &p)
        .and_then(|path| {
            crate::config::check_adapter_dir(&cfg, &p, &path, None)?;
            Ok(path)
        })
        .map_err(|e| bad(e.code(), e.to_string()))?;
    if !path.join("adapter_model.safetensors").is_file() {
        return Err(bad(
            "safetensors_required",
            "the adapter directory needs adapter_model.safetensors (pickle .bin is refused)",
        ));
    }
    // The same directory under the same name again: already served (no new id, no read),
    // unless the caller asks for vLLM's in-place reload (the files were replaced).
    let shown = path.display().to_string();
    let held = s.admin.adapters().into_iter().any(|a| {
        a.name == b.lora_name && a.version == "api" && a.loaded && a.path.as_ref() == Some(&shown)
    });
    if held && !b.load_inplace {
        return Ok(Json(LoraAnswer {
            status: "loaded",
            lora_name: b.lora_name,
        }));
    }
    let spec = mole_engine::api::AdapterSpec {
        name: b.lora_name.clone(),
        version: "api".into(),
        lora_id: s.next_lora_id.fetch_add(1, Ordering::SeqCst),
        path,
    };
    let e = s.admin.clone();
    let started = Instant::now();
    let r = tokio::task::spawn_blocking(move || e.load_adapter(spec)).await?;
    s.metrics
        .adapter_load_duration
        .with_label_values(&[if r.is_ok() { "ok" } else { "failed" }])
        .observe(started.elapsed().as_secs_f64());
    r?;
    Ok(Json(LoraAnswer {
        status: "loaded",
        lora_name: b.lora_name,
    }))
}

/// `POST /v1/unload_lora_adapter` (vLLM shape). Admin or operator token.
#[utoipa::path(post, path = "/v1/unload_lora_adapter", tag = "admin",
    request_body = LoadBody,
    responses((status = 200, description = "Unloaded", body = LoraAnswer), Refusals),
    security(("bearer" = [])))]
pub async fn unload_lora(
    State(s): S,
    Typed(b): Typed<LoadBody>,
) -> Result<Json<LoraAnswer>, ApiError> {
    s.admin.unload_adapter(&b.lora_name)?;
    // Its canary version goes with it (the config, until changed, loads it again).
    let _ = s
        .admin
        .unload_adapter(&mole_engine::lora::registry::canary_key(&b.lora_name));
    Ok(Json(LoraAnswer {
        status: "unloaded",
        lora_name: b.lora_name,
    }))
}

/// `POST /admin/reload` (admin or operator token), optional body `{"configHash": H}`:
/// re-reads the config file now. With H, a file whose parsed config hashes otherwise is
/// refused with 409 `config_stale` (the kubelet refreshes a mounted ConfigMap late) and
/// nothing changes; else it is applied and the answer carries the applied `configHash`.
#[utoipa::path(post, path = "/admin/reload", tag = "admin",
    request_body(content = Option<ReloadBody>, description = "Optional: the config hash expected"),
    responses(
        (status = 200, description = "Applied", body = crate::reload::ReloadOutcome),
        (status = 202, description = "Applying: adapters still load", body = ReloadApplying),
        Refusals,
    ),
    security(("bearer" = [])))]
pub async fn admin_reload(
    State(s): S,
    OptionalTyped(b): OptionalTyped<ReloadBody>,
) -> Result<Response, ApiError> {
    // A stale file is answered at once (the operator retries), even while a watcher reload
    // holds the reload lock.
    if let Some(want) = b.config_hash.clone() {
        let st = s.clone();
        tokio::task::spawn_blocking(move || st.check_config_hash(&want)).await??;
    }
    let st = s.clone();
    let want = b.config_hash.clone();
    let job = tokio::task::spawn_blocking(move || st.reload(want.as_deref()));
    // Loading large adapters can take longer than a caller should wait: after a while the
    // reload goes on in the background and the answer is 202; `/v1/lora_adapters` says when
    // each adapter is loaded.
    match tokio::time::timeout(RELOAD_ANSWER_WITHIN, job).await {
        Ok(joined) => Ok(Json(joined??).into_response()),
        Err(_) => Ok((
            StatusCode::ACCEPTED,
            Json(ReloadApplying {
                applying: true,
                config_hash: b.config_hash,
            }),
        )
            .into_response()),
    }
}
