//! A small in-memory Kubernetes API server behind a `kube::Client` (kube-rs's mock-service
//! pattern, answering by path instead of by a scripted order), and a stand-in for the worker
//! pods' HTTP API.
//!
//! It implements what the controllers use: GET of objects and collections (with label
//! selectors), server-side apply (whole object, bumping `metadata.generation` when the spec
//! changes; or `/status`, where a manager's top-level fields it no longer applies are removed),
//! JSON patch (finalizers), PUT with resourceVersion preconditions (409 on conflict), create
//! (409 when the name is taken), and Event creation.
//!
//! It authorizes as the chart does: a request the chart's ClusterRole and Role
//! (`charts/mole/templates/rbac.yaml`) do not grant is answered 403, so every scenario checks
//! that the operator's RBAC covers each call it makes. A write that sets `blockOwnerDeletion`
//! also needs `update` on the owner's `finalizers` (the API server's
//! OwnerReferencesPermissionEnforcement). What each thread's scenarios asked is kept
//! ([`rbac_used`]), so a test can check the other way round: that the chart grants nothing no
//! scenario needs.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use kube::client::Body;
use serde_json::{json, Value};

/// The fake API server's state.
#[derive(Default)]
pub struct Store {
    /// Object path (`/apis/.../namespaces/ns/kind/name`) → object.
    pub objects: BTreeMap<String, Value>,
    /// Every write: (method, path).
    pub writes: Vec<(String, String)>,
    /// Events published: reasons.
    pub events: Vec<String>,
    /// Events published: (reason, note).
    pub event_notes: Vec<(String, String)>,
    /// Requests to paths starting with one of these fail with 500 (an API outage).
    pub failing: Vec<String>,
    /// Every request: (verb, resource) as RBAC names them (`list`, `adapters`).
    pub requests: Vec<(String, String)>,
    /// Objects the API server sent back to GETs: 1 per object read, the items of each LIST.
    pub objects_read: usize,
    /// Writes refused 409 because their resourceVersion precondition was stale.
    pub conflicts: usize,
    /// Top-level status fields each field manager applied last, by object path.
    status_owners: BTreeMap<(String, String), Vec<String>>,
    rv: u64,
}

/// One RBAC rule of the chart: API groups, resources (`res` or `res/sub`), verbs.
#[derive(Debug)]
pub struct Rule {
    groups: Vec<String>,
    resources: Vec<String>,
    verbs: Vec<String>,
}

impl Rule {
    fn grants(&self, (group, resource, verb): &(String, String, String)) -> bool {
        self.groups.contains(group)
            && self.resources.contains(resource)
            && self.verbs.contains(verb)
    }
}

/// The rules of the chart's ClusterRole and leader Role, read from the template (its
/// `{{ ... }}` lines left out: the rules themselves are plain YAML).
pub fn chart_rules() -> &'static [Rule] {
    static RULES: std::sync::OnceLock<Vec<Rule>> = std::sync::OnceLock::new();
    RULES.get_or_init(|| {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../charts/mole/templates/rbac.yaml"
        );
        let text: String = std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .filter(|l| !l.contains("{{"))
            .map(|l| format!("{l}\n"))
            .collect();
        let mut rules = Vec::new();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let v: Value = serde::Deserialize::deserialize(doc).unwrap();
            if !matches!(v["kind"].as_str(), Some("ClusterRole" | "Role")) {
                continue;
            }
            let list = |r: &Value, k: &str| -> Vec<String> {
                r[k].as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_str().unwrap().to_string())
                    .collect()
            };
            for r in v["rules"].as_array().unwrap() {
                rules.push(Rule {
                    groups: list(r, "apiGroups"),
                    resources: list(r, "resources"),
                    verbs: list(r, "verbs"),
                });
            }
        }
        assert!(!rules.is_empty(), "no rules read from {path}");
        rules
    })
}

/// (API group, resource or `resource/subresource`, verb), as RBAC sees a request.
pub type Access = (String, String, String);

thread_local! {
    /// What the requests served on this thread asked of RBAC. A `#[tokio::test]` runs on a
    /// current-thread runtime, so its API calls are served on its own thread.
    static USED: std::cell::RefCell<std::collections::BTreeSet<Access>> = Default::default();
    /// The requests refused 403 on this thread.
    static DENIED: std::cell::RefCell<Vec<Access>> = Default::default();
}

/// What the requests served on this thread so far asked of RBAC.
pub fn rbac_used() -> std::collections::BTreeSet<Access> {
    USED.with(|u| u.borrow().clone())
}

/// The requests refused 403 on this thread so far.
pub fn rbac_denied() -> Vec<Access> {
    DENIED.with(|d| d.borrow().clone())
}

/// Every (group, resource, verb) the chart's ClusterRole and Role grant.
pub fn granted() -> std::collections::BTreeSet<Access> {
    let mut out = std::collections::BTreeSet::new();
    for r in chart_rules() {
        for g in &r.groups {
            for res in &r.resources {
                for v in &r.verbs {
                    out.insert((g.clone(), res.clone(), v.clone()));
                }
            }
        }
    }
    out
}

/// The `update` on `<owner>/finalizers` that setting `blockOwnerDeletion` on a reference to
/// the owner needs (the owner's resource named as its kind, lowercased, plural).
fn owner_finalizers(reference: &Value) -> Access {
    let group = reference["apiVersion"]
        .as_str()
        .unwrap_or("")
        .rsplit_once('/')
        .map_or("", |(g, _)| g);
    let kind = reference["kind"].as_str().unwrap_or("").to_lowercase();
    (
        group.to_string(),
        format!("{kind}s/finalizers"),
        "update".to_string(),
    )
}

/// What a request asks of RBAC: (API group, resource or `resource/subresource`, verb).
pub fn rbac_request(method: &str, path: &str, query: Option<&str>) -> (String, String, String) {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match parts.as_slice() {
        ["api", _v, rest @ ..] => (String::new(), rest),
        ["apis", g, _v, rest @ ..] => (g.to_string(), rest),
        _ => panic!("not an API path: {path}"),
    };
    let rest = match rest {
        ["namespaces", _ns, rest @ ..] if !rest.is_empty() => rest,
        r => r,
    };
    let (resource, named) = match rest {
        [res] => (res.to_string(), false),
        [res, _name] => (res.to_string(), true),
        [res, _name, sub] => (format!("{res}/{sub}"), true),
        _ => panic!("unexpected API path: {path}"),
    };
    let watch = query.is_some_and(|q| q.split('&').any(|kv| kv == "watch=true"));
    let verb = match (method, named) {
        ("GET", true) => "get",
        ("GET", false) if watch => "watch",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        (m, _) => panic!("unexpected method {m}"),
    };
    (group, resource, verb.to_string())
}

/// Shared handle on the store.
pub type Shared = Arc<Mutex<Store>>;

fn status(code: u16, reason: &str, message: &str) -> Response<Body> {
    let body = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                      "message": message, "reason": reason, "code": code});
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(&body).unwrap()))
        .unwrap()
}

fn ok(v: &Value) -> Response<Body> {
    Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(v).unwrap()))
        .unwrap()
}

fn matches_selector(obj: &Value, selector: Option<&str>) -> bool {
    let Some(sel) = selector else { return true };
    sel.split(',').filter(|s| !s.is_empty()).all(|kv| {
        let (k, v) = kv.split_once('=').unwrap();
        obj["metadata"]["labels"][k].as_str() == Some(v)
    })
}

fn query_param(query: Option<&str>, key: &str) -> Option<String> {
    query?.split('&').find_map(|p| {
        let (k, v) = p.split_once('=')?;
        (k == key).then(|| {
            v.replace("%3D", "=")
                .replace("%2C", ",")
                .replace("%2F", "/")
                .replace('+', " ")
        })
    })
}

impl Store {
    fn bump(&mut self, obj: &mut Value) {
        self.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(self.rv.to_string());
    }

    /// Inserts an object as a user would create it.
    pub fn create(&mut self, path: &str, mut obj: Value) {
        let name = obj["metadata"]["name"].as_str().unwrap().to_string();
        obj["metadata"]["uid"] = json!(format!("uid-{name}-{}", self.rv + 1));
        // One second apart, in the order created (the pool controller gives ids oldest first).
        let created = chrono::DateTime::parse_from_rfc3339("2026-11-22T12:00:00Z").unwrap()
            + chrono::Duration::seconds(self.rv as i64);
        obj["metadata"]["creationTimestamp"] = json!(created
            .with_timezone(&chrono::Utc)
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true));
        obj["metadata"]["generation"] = json!(1);
        self.bump(&mut obj);
        self.objects.insert(path.to_string(), obj);
    }

    /// The object at `path`.
    pub fn get(&self, path: &str) -> Option<Value> {
        self.objects.get(path).cloned()
    }

    fn handle(
        &mut self,
        method: &str,
        path: &str,
        query: Option<&str>,
        body: Value,
    ) -> Response<Body> {
        // MOLE_FAKE_TRACE=1 prints every request, to see what a scenario asks.
        if std::env::var_os("MOLE_FAKE_TRACE").is_some() {
            eprintln!("fake api: {method} {path}?{}", query.unwrap_or(""));
        }
        let mut want = rbac_request(method, path, query);
        let is_apply = method == "PATCH"
            && body.get("__json_patch").is_none()
            && body.get("__merge_patch").is_none();
        // A server-side apply that creates the object is authorized as `create`, as the API
        // server does.
        if is_apply && !want.1.contains('/') && !self.objects.contains_key(path) {
            want.2 = "create".into();
        }
        let mut asks = vec![want.clone()];
        if method == "POST" || (is_apply && !want.1.contains('/')) {
            asks.extend(
                body["metadata"]["ownerReferences"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|o| o["blockOwnerDeletion"] == json!(true))
                    .map(owner_finalizers),
            );
        }
        self.requests.push((want.2.clone(), want.1.clone()));
        for ask in asks {
            // MOLE_RBAC_LOG=FILE lists every call the scenarios make (group, resource, verb).
            if let Ok(f) = std::env::var("MOLE_RBAC_LOG") {
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(f)
                    .unwrap();
                writeln!(f, "{}\t{}\t{}", ask.0, ask.1, ask.2).unwrap();
            }
            USED.with(|u| u.borrow_mut().insert(ask.clone()));
            if !chart_rules().iter().any(|r| r.grants(&ask)) {
                DENIED.with(|d| d.borrow_mut().push(ask.clone()));
                return status(
                    403,
                    "Forbidden",
                    &format!("the chart's RBAC does not grant {ask:?}"),
                );
            }
        }
        if self.failing.iter().any(|f| path.starts_with(f.as_str())) {
            return status(500, "InternalError", "injected failure");
        }
        let (base, sub) = match path.strip_suffix("/status") {
            Some(b) => (b.to_string(), Some("status")),
            None => (path.to_string(), None),
        };
        match method {
            "GET" if want.2 == "watch" => {
                // A watch that ends at once without events (the watcher asks again later).
                Response::builder()
                    .status(200)
                    .header("content-type", "application/json")
                    .body(Body::empty())
                    .unwrap()
            }
            "GET" => {
                if let Some(o) = self.objects.get(&base) {
                    self.objects_read += 1;
                    // A text subresource (a pod's log) is stored as a string, served as is.
                    if let Some(text) = o.as_str() {
                        return Response::builder()
                            .status(200)
                            .header("content-type", "text/plain")
                            .body(Body::from(text.as_bytes().to_vec()))
                            .unwrap();
                    }
                    return ok(o);
                }
                if !self.is_collection_path(&base) {
                    return status(404, "NotFound", &format!("{base} not found"));
                }
                let prefix = format!("{base}/");
                let sel = query_param(query, "labelSelector");
                let items: Vec<Value> = self
                    .objects
                    .iter()
                    .filter(|(k, _)| k.starts_with(&prefix) && !k[prefix.len()..].contains('/'))
                    .map(|(_, v)| v.clone())
                    .filter(|v| matches_selector(v, sel.as_deref()))
                    .collect();
                self.objects_read += items.len();
                ok(&json!({"kind": "List", "apiVersion": "v1",
                           "metadata": {"resourceVersion": self.rv.to_string()}, "items": items}))
            }
            "POST" if path.ends_with("/events") => {
                let reason = body["reason"].as_str().unwrap_or("").to_string();
                let note = body["note"]
                    .as_str()
                    .or(body["message"].as_str())
                    .unwrap_or("")
                    .to_string();
                self.events.push(reason.clone());
                self.event_notes.push((reason, note));
                ok(&body)
            }
            "PATCH" if body.get("__merge_patch").is_some() => {
                // A repeated Event (kube's Recorder patches its series); Events are not kept.
                if path.contains("/events/") {
                    return ok(&body["__merge_patch"]);
                }
                let Some(mut obj) = self.objects.get(&base).cloned() else {
                    return status(404, "NotFound", "not found");
                };
                merge(&mut obj, &body["__merge_patch"]);
                self.writes.push(("PATCH".into(), path.into()));
                self.bump(&mut obj);
                self.objects.insert(base, obj.clone());
                ok(&obj)
            }
            "PATCH" if body.get("__json_patch").is_some() => {
                let Some(mut obj) = self.objects.get(&base).cloned() else {
                    return status(404, "NotFound", "not found");
                };
                // Like the real API server, a `test` for null passes when the field is absent.
                let ops: Vec<Value> = body["__json_patch"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|op| {
                        !(op["op"] == "test"
                            && op["value"].is_null()
                            && obj
                                .pointer(op["path"].as_str().unwrap())
                                .is_none_or(Value::is_null))
                    })
                    .cloned()
                    .collect();
                let patch: json_patch::Patch = serde_json::from_value(Value::Array(ops)).unwrap();
                if json_patch::patch(&mut obj, &patch).is_err() {
                    return status(422, "Invalid", "json patch test failed");
                }
                self.writes.push(("PATCH".into(), path.into()));
                self.bump(&mut obj);
                // The object goes when its last finalizer does, once deletion was asked.
                let gone = obj["metadata"].get("deletionTimestamp").is_some()
                    && obj["metadata"]["finalizers"]
                        .as_array()
                        .is_none_or(|f| f.is_empty());
                if gone {
                    self.objects.remove(&base);
                } else {
                    self.objects.insert(base, obj.clone());
                }
                ok(&obj)
            }
            "PATCH" => {
                // Server-side apply: the applied fields win; for /status only the status.
                self.writes.push(("APPLY".into(), path.into()));
                let manager = query_param(query, "fieldManager").unwrap_or_default();
                // A resourceVersion in the applied object is a precondition, as for a PUT.
                if let (Some(rv), Some(existing)) = (
                    body["metadata"]["resourceVersion"].as_str(),
                    self.objects.get(&base),
                ) {
                    if existing["metadata"]["resourceVersion"].as_str() != Some(rv) {
                        self.conflicts += 1;
                        return status(409, "Conflict", "the object has been modified");
                    }
                }
                let mut obj = match (self.objects.get(&base).cloned(), sub) {
                    (Some(mut existing), Some(_)) => {
                        let mut st = existing.get("status").cloned().unwrap_or(json!({}));
                        // Fields this manager applied before and omits now are removed: the
                        // top-level ones, and the keys of an object it applies (a map such as
                        // `loraIds`: an entry left out of the apply goes).
                        let mut applied: Vec<String> = Vec::new();
                        for (k, v) in body["status"].as_object().into_iter().flatten() {
                            applied.push(k.clone());
                            for sub in v.as_object().into_iter().flat_map(|o| o.keys()) {
                                applied.push(format!("{k}/{sub}"));
                            }
                        }
                        let owner_key = (base.clone(), manager);
                        if let Some(prev) = self.status_owners.get(&owner_key) {
                            for k in prev.iter().filter(|k| !applied.contains(k)) {
                                let st = st.as_object_mut().unwrap();
                                match k.split_once('/') {
                                    None => {
                                        st.remove(k);
                                    }
                                    Some((top, sub)) => {
                                        if let Some(o) =
                                            st.get_mut(top).and_then(Value::as_object_mut)
                                        {
                                            o.remove(sub);
                                        }
                                    }
                                }
                            }
                        }
                        self.status_owners.insert(owner_key, applied);
                        merge(&mut st, &body["status"]);
                        existing["status"] = st;
                        existing
                    }
                    (None, Some(_)) => return status(404, "NotFound", "not found"),
                    (Some(mut existing), None) => {
                        let keep_status = existing.get("status").cloned();
                        let meta = existing["metadata"].clone();
                        let spec_changed = existing.get("spec") != body.get("spec");
                        existing = body.clone();
                        let mut m = meta;
                        merge(&mut m, &body["metadata"]);
                        if spec_changed {
                            let g = m["generation"].as_i64().unwrap_or(0);
                            m["generation"] = json!(g + 1);
                        }
                        existing["metadata"] = m;
                        if let Some(s) = keep_status {
                            existing["status"] = s;
                        }
                        existing
                    }
                    (None, None) => {
                        let mut o = body.clone();
                        o["metadata"]["uid"] = json!(format!("uid-{}", self.rv + 1));
                        o["metadata"]["generation"] = json!(1);
                        o
                    }
                };
                self.bump(&mut obj);
                self.objects.insert(base, obj.clone());
                ok(&obj)
            }
            "PUT" => {
                let Some(existing) = self.objects.get(&base) else {
                    return status(404, "NotFound", "not found");
                };
                if body["metadata"]["resourceVersion"] != existing["metadata"]["resourceVersion"] {
                    self.conflicts += 1;
                    return status(409, "Conflict", "the object has been modified");
                }
                self.writes.push(("PUT".into(), path.into()));
                let mut obj = existing.clone();
                if sub.is_some() {
                    obj["status"] = body["status"].clone();
                } else {
                    obj = body;
                }
                self.bump(&mut obj);
                self.objects.insert(base, obj.clone());
                ok(&obj)
            }
            "DELETE" => {
                self.writes.push(("DELETE".into(), path.into()));
                match self.objects.remove(&base) {
                    Some(o) => ok(&o),
                    None => status(404, "NotFound", "not found"),
                }
            }
            "POST" => {
                // Create: 409 when the name is taken.
                let name = body["metadata"]["name"].as_str().unwrap_or("").to_string();
                let item = format!("{base}/{name}");
                if self.objects.contains_key(&item) {
                    return status(409, "AlreadyExists", &format!("{name} already exists"));
                }
                self.writes.push(("POST".into(), item.clone()));
                let mut o = body;
                // Unique per creation, as the API server's: an object deleted and created
                // again under its name is another object.
                o["metadata"]["uid"] = json!(format!("uid-{name}-{}", self.rv + 1));
                self.bump(&mut o);
                self.objects.insert(item, o.clone());
                Response::builder()
                    .status(201)
                    .header("content-type", "application/json")
                    .body(Body::from(serde_json::to_vec(&o).unwrap()))
                    .unwrap()
            }
            _ => status(405, "MethodNotAllowed", method),
        }
    }

    fn is_collection_path(&self, base: &str) -> bool {
        // `/api/v1/namespaces/ns/pods`, `/apis/g/v/namespaces/ns/kinds`: an even number of
        // segments after `namespaces`.
        base.contains("/namespaces/")
            && base
                .split("/namespaces/")
                .nth(1)
                .is_some_and(|r| r.split('/').count() == 2)
    }
}

/// Recursive JSON merge (objects merged, everything else replaced).
pub fn merge(into: &mut Value, from: &Value) {
    match (into, from) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (a, b) => *a = b.clone(),
    }
}

/// Brings the controllers' stores up to date with the objects `store` holds, as their watches
/// would (a fresh list: Init, InitApply each, InitDone), without a request to the API server.
pub fn sync_stores(store: &Shared, w: &mut mole_operator::controller::StoreWriters) {
    let objects = store.lock().unwrap().objects.clone();
    sync_stores_to(&objects, w);
}

/// What the API server holds now, for a lagging watch to deliver later
/// ([`sync_stores_to`]).
pub fn snapshot(store: &Shared) -> BTreeMap<String, Value> {
    store.lock().unwrap().objects.clone()
}

/// Brings the controllers' stores to the objects of `objects` (a [`snapshot`] taken earlier:
/// a watch that lags behind the API server, as a reflector does between a write and its
/// watch event).
pub fn sync_stores_to(
    objects: &BTreeMap<String, Value>,
    w: &mut mole_operator::controller::StoreWriters,
) {
    use kube::runtime::watcher::Event;
    let of = |kind: &str| -> Vec<Value> {
        objects
            .iter()
            .filter(|(k, _)| k.starts_with("/apis/mole.dev/") && k.split('/').nth(6) == Some(kind))
            .map(|(_, v)| v.clone())
            .collect()
    };
    w.pools.apply_watcher_event(&Event::Init);
    for p in of("inferencepools") {
        w.pools
            .apply_watcher_event(&Event::InitApply(serde_json::from_value(p).unwrap()));
    }
    w.pools.apply_watcher_event(&Event::InitDone);
    w.adapters.apply_watcher_event(&Event::Init);
    for a in of("adapters") {
        w.adapters
            .apply_watcher_event(&Event::InitApply(serde_json::from_value(a).unwrap()));
    }
    w.adapters.apply_watcher_event(&Event::InitDone);
}

/// A kube Client whose API server is `store`.
pub fn client(store: Shared) -> kube::Client {
    let svc = tower::service_fn(move |req: Request<Body>| {
        let store = store.clone();
        async move {
            let method = req.method().to_string();
            let path = req.uri().path().to_string();
            let query = req.uri().query().map(str::to_string);
            let content_type = req
                .headers()
                .get("content-type")
                .map(|c| c.as_bytes().to_vec())
                .unwrap_or_default();
            let json_patch = content_type.starts_with(b"application/json-patch");
            let merge_patch = content_type.starts_with(b"application/merge-patch");
            let bytes = req.into_body().collect().await.unwrap().to_bytes();
            let mut body: Value = if bytes.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&bytes).unwrap_or(Value::Null)
            };
            if json_patch {
                body = json!({"__json_patch": body});
            } else if merge_patch {
                body = json!({"__merge_patch": body});
            }
            let resp = store
                .lock()
                .unwrap()
                .handle(&method, &path, query.as_deref(), body);
            Ok::<_, Infallible>(resp)
        }
    });
    kube::Client::new(svc, "ml")
}

/// The operator token the fake API server holds for pool `vl` (what the operator created).
pub fn stored_token(store: &Shared) -> Option<String> {
    let s = store
        .lock()
        .unwrap()
        .get("/api/v1/namespaces/ml/secrets/vl-operator-token")?;
    let s: k8s_openapi::api::core::v1::Secret = serde_json::from_value(s).ok()?;
    String::from_utf8(s.data?.get("token")?.0.clone()).ok()
}

/// A stand-in for the worker pods' HTTP API. Like the real worker it requires the operator's
/// token (read from the pool's Secret in the fake API server) on every endpoint the operator
/// calls, and answers `POST /admin/reload` with 409 `config_stale` until the test says the
/// kubelet refreshed the mounted file ([`FakeWorker::file_hash`]).
pub struct FakeWorker {
    /// Address it listens on.
    pub addr: SocketAddr,
    /// The `/v1/lora_adapters` response.
    pub adapters: Arc<Mutex<Value>>,
    /// Authorized calls received (path and body), reloads included whatever they answered.
    pub calls: Arc<Mutex<Vec<(String, Value)>>>,
    /// Content hash of the config file as the pod sees it (None: never refreshed).
    pub file_hash: Arc<Mutex<Option<String>>>,
    /// Config hashes the pod accepted (200 on reload).
    pub applied: Arc<Mutex<Vec<String>>>,
    /// Requests refused for a missing or wrong token.
    pub unauthorized: Arc<Mutex<usize>>,
    /// `GET /v1/lora_adapters` calls answered (the operator's polls of a pod).
    pub listings: Arc<std::sync::atomic::AtomicUsize>,
    /// When set, `POST /admin/reload` answers this status and JSON body (a worker refusing
    /// the config) instead of applying or answering `config_stale`.
    pub reload_error: Arc<Mutex<Option<(u16, Value)>>>,
}

/// Starts a [`FakeWorker`] on 127.0.0.1 that checks tokens against `store`.
pub async fn fake_worker(store: Shared) -> FakeWorker {
    use axum::http::HeaderMap;
    use axum::response::IntoResponse;
    use axum::routing::{get, post};
    let adapters = Arc::new(Mutex::new(
        json!({"object": "list", "base_model": "b", "data": []}),
    ));
    let calls: Arc<Mutex<Vec<(String, Value)>>> = Arc::default();
    let file_hash: Arc<Mutex<Option<String>>> = Arc::default();
    let applied: Arc<Mutex<Vec<String>>> = Arc::default();
    let unauthorized: Arc<Mutex<usize>> = Arc::default();
    let reload_error: Arc<Mutex<Option<(u16, Value)>>> = Arc::default();
    let listings: Arc<std::sync::atomic::AtomicUsize> = Arc::default();
    let listed = listings.clone();
    let authorized = {
        let (store, unauthorized) = (store.clone(), unauthorized.clone());
        move |h: &HeaderMap| {
            let want = stored_token(&store).map(|t| format!("Bearer {t}"));
            let ok = want.is_some()
                && h.get("authorization").and_then(|v| v.to_str().ok()) == want.as_deref();
            if !ok {
                *unauthorized.lock().unwrap() += 1;
            }
            ok
        }
    };
    let denied = || {
        (
            StatusCode::UNAUTHORIZED,
            axum::Json(json!({"error": {"message": "missing or wrong token", "type": "auth", "code": "unauthorized"}})),
        )
            .into_response()
    };
    let (a, c1, c2, fh, ap, re) = (
        adapters.clone(),
        calls.clone(),
        calls.clone(),
        file_hash.clone(),
        applied.clone(),
        reload_error.clone(),
    );
    let (auth1, auth2, auth3) = (authorized.clone(), authorized.clone(), authorized);
    let app = axum::Router::new()
        .route(
            "/v1/lora_adapters",
            get(move |h: HeaderMap| {
                let a = a.clone();
                let listed = listed.clone();
                let ok = auth1(&h);
                async move {
                    if !ok {
                        return denied();
                    }
                    listed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    axum::Json(a.lock().unwrap().clone()).into_response()
                }
            }),
        )
        .route(
            "/admin/reload",
            post(move |h: HeaderMap, axum::Json(b): axum::Json<Value>| {
                let (c, fh, ap, re) = (c1.clone(), fh.clone(), ap.clone(), re.clone());
                let ok = auth2(&h);
                async move {
                    if !ok {
                        return denied();
                    }
                    c.lock().unwrap().push(("/admin/reload".into(), b.clone()));
                    if let Some((code, body)) = re.lock().unwrap().clone() {
                        return (StatusCode::from_u16(code).unwrap(), axum::Json(body))
                            .into_response();
                    }
                    let want = b["configHash"].as_str().unwrap_or("").to_string();
                    if fh.lock().unwrap().as_deref() == Some(want.as_str()) {
                        ap.lock().unwrap().push(want);
                        StatusCode::OK.into_response()
                    } else {
                        (
                            StatusCode::CONFLICT,
                            axum::Json(json!({"error": {"message": "the config file is older than the requested hash", "type": "conflict", "code": "config_stale"}})),
                        )
                            .into_response()
                    }
                }
            }),
        )
        .route(
            "/v1/unload_lora_adapter",
            post(move |h: HeaderMap, axum::Json(b): axum::Json<Value>| {
                let c = c2.clone();
                let ok = auth3(&h);
                async move {
                    if !ok {
                        return denied();
                    }
                    c.lock()
                        .unwrap()
                        .push(("/v1/unload_lora_adapter".into(), b));
                    StatusCode::OK.into_response()
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    FakeWorker {
        addr,
        adapters,
        calls,
        file_hash,
        applied,
        unauthorized,
        reload_error,
        listings,
    }
}
