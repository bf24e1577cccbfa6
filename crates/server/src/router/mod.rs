//! Picks the adapter for a request. [`decide`] is a pure function of the config, the request
//! and (for the classifier strategy) a scoring callback, so every strategy is unit-tested
//! without a model. Strategies run in the configured order; the first that answers wins.

pub mod embed;

use mole_api::{RouterFallback, RouterStrategy, ServingMode, WorkerConfig};

/// Why routing failed. Stable names via [`RouteError::code`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouteError {
    /// The request names a model that is neither the pool, the base model nor an adapter.
    #[error("unknown model {0}")]
    UnknownModel(String),
    /// No strategy matched and the fallback is `reject`.
    #[error("no adapter matched the request and the router fallback is reject")]
    NoRoute,
}

impl RouteError {
    /// Stable name (metric label, JSON `code`).
    pub fn code(&self) -> &'static str {
        match self {
            RouteError::UnknownModel(_) => "model_not_found",
            RouteError::NoRoute => "no_route",
        }
    }
}

/// The outcome of routing.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Adapter name, None for the base model.
    pub adapter: Option<String>,
    /// Which rule decided: `explicit`, `classifier`, `keywords`, `embedding`, `fallback`.
    pub reason: String,
    /// Confidence (classifier probability, embedding cosine) when the rule has one.
    pub score: Option<f64>,
    /// How the adapter is served.
    pub mode: Mode,
}

/// How a routed request is served: the names are the `x-mole-mode` header, the `mode` JSON
/// field and the `mode` metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// A LoRA adapter applied at run time over the shared base weights.
    Dynamic,
    /// An adapter merged into its own copy of the weights (its pods, or this process).
    Merged,
    /// The base model, no adapter.
    Base,
}

impl Mode {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Dynamic => "dynamic",
            Mode::Merged => "merged",
            Mode::Base => "base",
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the router sees of a request.
#[derive(Debug, Clone, Default)]
pub struct RouteInput<'a> {
    /// `model` of the request.
    pub model: &'a str,
    /// An explicit `adapter`/`expert` field, which wins over `model`.
    pub adapter: Option<&'a str>,
    /// Text of the prompt (last user message for chat).
    pub text: &'a str,
}

/// Scores labels with the classifier adapter (engine `score_labels`); None when unavailable.
pub type Scorer<'a> = &'a dyn Fn(&str, &str, &[String]) -> Option<Vec<f32>>;
/// Embeds texts (L2-normalised); None when no embedding model is configured.
pub type Embedder<'a> = &'a dyn Fn(&[String]) -> Option<Vec<Vec<f32>>>;

fn mode_of(cfg: &WorkerConfig, adapter: &Option<String>) -> Mode {
    if cfg.merged.is_some() && adapter.is_some() {
        return Mode::Merged;
    }
    match adapter {
        None => Mode::Base,
        // A merged endpoint says merged pods serve it, whatever the spec's mode (an `auto`
        // adapter the operator promoted keeps `mode: auto`).
        Some(n) => match cfg.adapters.iter().find(|a| &a.name == n) {
            Some(a) if a.mode == ServingMode::Merged || a.merged_endpoint.is_some() => Mode::Merged,
            _ => Mode::Dynamic,
        },
    }
}

fn done(cfg: &WorkerConfig, adapter: Option<String>, reason: &str, score: Option<f64>) -> Decision {
    let mode = mode_of(cfg, &adapter);
    Decision {
        adapter,
        reason: reason.into(),
        score,
        mode,
    }
}

/// Routes a request.
pub fn decide(
    cfg: &WorkerConfig,
    input: &RouteInput<'_>,
    scorer: Scorer<'_>,
    embedder: Embedder<'_>,
) -> Result<Decision, RouteError> {
    // The pool name (or empty / "auto") means "let the router decide"; the base model name
    // means "no adapter"; anything else must be an adapter.
    let named = input.adapter.unwrap_or(input.model);
    let routed = named.is_empty() || named == cfg.pool || named == "auto";
    if let Some(m) = &cfg.merged {
        // A merged pod serves one model, its adapter baked into the weights: the base model
        // is not here to answer.
        if routed || named == m.adapter || by_label(cfg, named) == Some(m.adapter.as_str()) {
            return Ok(done(cfg, Some(m.adapter.clone()), "explicit", None));
        }
        return Err(RouteError::UnknownModel(named.into()));
    }
    if !routed {
        if named == cfg.base_model.name {
            return Ok(done(cfg, None, "explicit", None));
        }
        if cfg.adapters.iter().any(|a| a.name == named) {
            return Ok(done(cfg, Some(named.into()), "explicit", None));
        }
        // The seeds name experts by label (`expert: "json"`), not by adapter name.
        if let Some(n) = by_label(cfg, named) {
            return Ok(done(cfg, Some(n.into()), "explicit", None));
        }
        return Err(RouteError::UnknownModel(named.into()));
    }
    for s in &cfg.router.strategies {
        let decided = match s {
            RouterStrategy::Explicit => None,
            RouterStrategy::Classifier => by_classifier(cfg, input.text, scorer),
            RouterStrategy::Keywords => by_keywords(cfg, input.text),
            RouterStrategy::Embedding => by_embedding(cfg, input.text, embedder),
        };
        if let Some(d) = decided {
            return Ok(d);
        }
    }
    match cfg.router.fallback {
        RouterFallback::Base => Ok(done(cfg, None, "fallback", None)),
        RouterFallback::Reject => Err(RouteError::NoRoute),
    }
}

/// The classifier adapter's most likely label, when it reaches `minConfidence`.
fn by_classifier(cfg: &WorkerConfig, text: &str, scorer: Scorer<'_>) -> Option<Decision> {
    let cls = cfg.router.classifier_adapter.as_ref()?;
    let labelled: Vec<(&str, String)> = cfg
        .adapters
        .iter()
        .filter_map(|a| a.routing.label.clone().map(|l| (a.name.as_str(), l)))
        .collect();
    if labelled.is_empty() {
        return None;
    }
    let labels: Vec<String> = labelled.iter().map(|(_, l)| l.clone()).collect();
    let p = scorer(cls, text, &labels)?;
    let (i, best) = p
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .filter(|(_, v)| f64::from(**v) >= cfg.router.min_confidence)?;
    Some(done(
        cfg,
        Some(labelled[i].0.into()),
        "classifier",
        Some(f64::from(*best)),
    ))
}

/// The adapter with the most keyword and file-extension hits; ties go to config order so the
/// result is stable.
fn by_keywords(cfg: &WorkerConfig, text: &str) -> Option<Decision> {
    let text_l = text.to_lowercase();
    let mut best: Option<(usize, &str)> = None;
    for a in &cfg.adapters {
        let hits = a
            .routing
            .keywords
            .iter()
            .filter(|k| !k.is_empty() && text_l.contains(&k.to_lowercase()))
            .count()
            + a.routing
                .extensions
                .iter()
                .filter(|e| has_extension(&text_l, e))
                .count();
        if hits > 0 && best.is_none_or(|(b, _)| hits > b) {
            best = Some((hits, &a.name));
        }
    }
    let (h, n) = best?;
    Some(done(cfg, Some(n.into()), "keywords", Some(h as f64)))
}

/// The adapter whose description or example is nearest the prompt in meaning (cosine), when
/// it reaches `embeddingThreshold`.
fn by_embedding(cfg: &WorkerConfig, text: &str, embedder: Embedder<'_>) -> Option<Decision> {
    let mut texts = vec![text.to_string()];
    let mut owners = Vec::new();
    for a in &cfg.adapters {
        for t in a
            .routing
            .description
            .iter()
            .chain(a.routing.examples.iter())
        {
            texts.push(t.clone());
            owners.push(a.name.as_str());
        }
    }
    if owners.is_empty() {
        return None;
    }
    let v = embedder(&texts)?;
    let q = &v[0];
    let (i, s) = v[1..]
        .iter()
        .map(|e| q.iter().zip(e).map(|(a, b)| a * b).sum::<f32>())
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(&b.1))?;
    (f64::from(s) >= cfg.router.embedding_threshold)
        .then(|| done(cfg, Some(owners[i].into()), "embedding", Some(f64::from(s))))
}

/// The adapter whose `label` is `label` (exact first, then ignoring case; config order breaks
/// ties).
fn by_label<'a>(cfg: &'a WorkerConfig, label: &str) -> Option<&'a str> {
    let labelled = || {
        cfg.adapters
            .iter()
            .filter_map(|a| Some((a.name.as_str(), a.routing.label.as_deref()?)))
    };
    labelled()
        .find(|(_, l)| *l == label)
        .or_else(|| labelled().find(|(_, l)| l.eq_ignore_ascii_case(label)))
        .map(|(n, _)| n)
}

fn has_extension(text_l: &str, ext: &str) -> bool {
    let e = ext.trim_start_matches('.').to_lowercase();
    if e.is_empty() {
        return false;
    }
    let pat = format!(".{e}");
    text_l.match_indices(&pat).any(|(i, _)| {
        let after = text_l[i + pat.len()..].chars().next();
        let before = text_l[..i].chars().next_back();
        before.is_some_and(|c| c.is_alphanumeric() || c == '_')
            && after.is_none_or(|c| !c.is_alphanumeric())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(strategies: &str, fallback: &str) -> WorkerConfig {
        serde_yaml::from_str(&format!(
                r#"
pool: p
baseModel: {{name: base, path: b}}
adapters:
  - {{name: fr, version: v1, loraId: 1, path: fr, label: french, keywords: [french, bonjour], description: "answers in French"}}
  - {{name: js, version: v1, loraId: 2, path: js, label: json, keywords: [json], extensions: [py], mode: merged}}
router:
  strategies: {strategies}
  classifierAdapter: fr
  minConfidence: 0.6
  embeddingThreshold: 0.5
  fallback: {fallback}
"#
        ))
        .unwrap()
    }
    fn none_s(_: &str, _: &str, _: &[String]) -> Option<Vec<f32>> {
        None
    }
    fn none_e(_: &[String]) -> Option<Vec<Vec<f32>>> {
        None
    }
    fn inp<'a>(model: &'a str, text: &'a str) -> RouteInput<'a> {
        RouteInput {
            model,
            adapter: None,
            text,
        }
    }

    #[test]
    fn explicit_names_win_and_unknown_is_refused() {
        let c = cfg("[explicit, keywords]", "base");
        let d = decide(&c, &inp("js", "bonjour"), &none_s, &none_e).unwrap();
        assert_eq!(
            (d.adapter.as_deref(), d.reason.as_str(), d.mode),
            (Some("js"), "explicit", Mode::Merged)
        );
        let d = decide(&c, &inp("base", "bonjour"), &none_s, &none_e).unwrap();
        assert_eq!((d.adapter, d.mode), (None, Mode::Base));
        let e = decide(&c, &inp("nope", "x"), &none_s, &none_e).unwrap_err();
        assert_eq!(e.code(), "model_not_found");
        let i = RouteInput {
            model: "p",
            adapter: Some("fr"),
            text: "json",
        };
        assert_eq!(
            decide(&c, &i, &none_s, &none_e).unwrap().adapter.as_deref(),
            Some("fr")
        );
    }

    /// The operator promotes an `auto` adapter by its traffic: its WorkerConfig entry keeps
    /// `mode: auto` (the spec's) and gets the merged Service's `mergedEndpoint`, which says
    /// merged pods serve it, so requests for it are merged ones (the gateway forwards them).
    /// They were decided dynamic: a promoted adapter's merged pods never got a request
    /// (tests/fleet_e2e.rs, promotion under traffic). Without an endpoint it stays dynamic.
    #[test]
    fn an_adapter_with_a_merged_endpoint_is_served_merged_whatever_its_mode() {
        let mut c = cfg("[explicit]", "base");
        c.adapters[0].mode = ServingMode::Auto;
        let d = decide(&c, &inp("fr", "x"), &none_s, &none_e).unwrap();
        assert_eq!(d.mode, Mode::Dynamic);
        c.adapters[0].merged_endpoint = Some("http://p-fr.ml.svc:8000".into());
        let d = decide(&c, &inp("fr", "x"), &none_s, &none_e).unwrap();
        assert_eq!(d.mode, Mode::Merged);
    }

    #[test]
    fn modes_keep_their_wire_names() {
        for (m, name) in [
            (Mode::Dynamic, "dynamic"),
            (Mode::Merged, "merged"),
            (Mode::Base, "base"),
        ] {
            assert_eq!((m.as_str(), m.to_string()), (name, name.to_string()));
            assert_eq!(serde_json::to_value(m).unwrap(), name);
        }
    }

    #[test]
    fn explicit_expert_and_adapter_match_labels() {
        let c = cfg("[explicit, keywords]", "reject");
        // `expert: "json"` (the label of js), and the label ignoring case.
        for (adapter, model) in [(Some("json"), "p"), (Some("JSON"), "p"), (None, "french")] {
            let i = RouteInput {
                model,
                adapter,
                text: "bonjour",
            };
            let d = decide(&c, &i, &none_s, &none_e).unwrap();
            assert_eq!(d.reason, "explicit", "{adapter:?} {model}");
            assert_eq!(
                d.adapter.as_deref(),
                Some(if model == "french" { "fr" } else { "js" })
            );
        }
        // A name wins over a label; an unknown label is still refused.
        let i = RouteInput {
            model: "p",
            adapter: Some("nolabel"),
            text: "",
        };
        assert_eq!(
            decide(&c, &i, &none_s, &none_e).unwrap_err().code(),
            "model_not_found"
        );
    }

    #[test]
    fn keywords_and_extensions() {
        let c = cfg("[explicit, keywords]", "base");
        let d = decide(&c, &inp("p", "Give me JSON please"), &none_s, &none_e).unwrap();
        assert_eq!(
            (d.adapter.as_deref(), d.reason.as_str()),
            (Some("js"), "keywords")
        );
        let d = decide(&c, &inp("p", "fix main.py now"), &none_s, &none_e).unwrap();
        assert_eq!(d.adapter.as_deref(), Some("js"));
        // "python" must not count as the .py extension.
        let d = decide(&c, &inp("p", "I like .python"), &none_s, &none_e).unwrap();
        assert_eq!(d.reason, "fallback");
        let d = decide(&c, &inp("p", "bonjour in french"), &none_s, &none_e).unwrap();
        assert_eq!(d.adapter.as_deref(), Some("fr"));
    }

    #[test]
    fn classifier_argmax_and_min_confidence() {
        let c = cfg("[classifier, keywords]", "reject");
        let hi = |_: &str, _: &str, l: &[String]| -> Option<Vec<f32>> {
            assert_eq!(l, ["french", "json"]);
            Some(vec![0.2, 0.8])
        };
        let d = decide(&c, &inp("p", "hello"), &hi, &none_e).unwrap();
        assert_eq!(
            (d.adapter.as_deref(), d.reason.as_str(), d.score),
            (Some("js"), "classifier", Some(0.800000011920929))
        );
        let low = |_: &str, _: &str, _: &[String]| -> Option<Vec<f32>> { Some(vec![0.45, 0.55]) };
        // Below minConfidence: falls through to keywords, then to the reject fallback.
        let d = decide(&c, &inp("p", "bonjour"), &low, &none_e).unwrap();
        assert_eq!(d.reason, "keywords");
        assert_eq!(
            decide(&c, &inp("p", "hello"), &low, &none_e)
                .unwrap_err()
                .code(),
            "no_route"
        );
    }

    #[test]
    fn embedding_threshold() {
        let c = cfg("[embedding]", "base");
        // Query close to the only description (fr).
        let close = |t: &[String]| -> Option<Vec<Vec<f32>>> {
            assert_eq!(t.len(), 2);
            Some(vec![vec![1.0, 0.0], vec![0.8, 0.6]])
        };
        let d = decide(&c, &inp("p", "q"), &none_s, &close).unwrap();
        assert_eq!(
            (d.adapter.as_deref(), d.reason.as_str()),
            (Some("fr"), "embedding")
        );
        let far =
            |_: &[String]| -> Option<Vec<Vec<f32>>> { Some(vec![vec![1.0, 0.0], vec![0.0, 1.0]]) };
        assert_eq!(
            decide(&c, &inp("p", "q"), &none_s, &far).unwrap().reason,
            "fallback"
        );
    }
}
