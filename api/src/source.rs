//! Where a model or adapter comes from: `hf://org/model[@revision]`, `s3://bucket/prefix` or
//! `pvc://claim/path`. The operator validates the URIs of `baseModel.source` and an Adapter's
//! `source.uri` with the same parser the worker's `fetch` runs.

/// Why a source URI was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct SourceError {
    /// What is wrong with it.
    pub reason: String,
}

/// A parsed source URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// `hf://org/model[@revision]`.
    Hf {
        /// `org/model`.
        repo: String,
        /// Branch, tag or commit; `main` when not given.
        revision: String,
    },
    /// `s3://bucket/prefix`.
    S3 {
        /// Bucket name.
        bucket: String,
        /// Key prefix (no leading slash; may be empty).
        prefix: String,
    },
    /// `pvc://claim/path`: mounted by the operator.
    Pvc {
        /// Claim name.
        claim: String,
        /// Path inside the claim.
        path: String,
    },
}

impl ModelSource {
    /// Parses `hf://`, `s3://` and `pvc://` URIs (the same rules the operator validates).
    pub fn parse(uri: &str) -> Result<ModelSource, SourceError> {
        let bad = |reason: &str| SourceError {
            reason: reason.to_string(),
        };
        let (scheme, rest) = uri
            .split_once("://")
            .ok_or_else(|| bad("expected hf://, s3:// or pvc://"))?;
        if rest.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad("contains whitespace"));
        }
        let segments: Vec<&str> = rest.split('/').collect();
        if segments
            .iter()
            .any(|s| *s == ".." || *s == "." || s.contains('\\'))
        {
            return Err(bad("contains a '.' or '..' segment"));
        }
        match scheme {
            "hf" => {
                let (path, revision) = match rest.split_once('@') {
                    Some((p, r)) if !r.is_empty() => (p, r.to_string()),
                    Some(_) => return Err(bad("empty revision after '@'")),
                    None => (rest, "main".to_string()),
                };
                let parts: Vec<&str> = path.split('/').collect();
                if parts.is_empty()
                    || parts.len() > 2
                    || parts.iter().any(|p| {
                        p.is_empty()
                            || !p
                                .chars()
                                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
                    })
                {
                    return Err(bad("expected hf://org/model[@revision]"));
                }
                Ok(ModelSource::Hf {
                    repo: path.to_string(),
                    revision,
                })
            }
            "s3" => {
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                if bucket.len() < 3
                    || bucket.len() > 63
                    || !bucket
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-.".contains(c))
                {
                    return Err(bad("expected s3://bucket/prefix with a valid bucket name"));
                }
                Ok(ModelSource::S3 {
                    bucket: bucket.to_string(),
                    prefix: prefix.trim_matches('/').to_string(),
                })
            }
            "pvc" => {
                let (claim, path) = rest.split_once('/').unwrap_or((rest, ""));
                if claim.is_empty()
                    || !claim
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-.".contains(c))
                {
                    return Err(bad("expected pvc://claim/path with a valid claim name"));
                }
                Ok(ModelSource::Pvc {
                    claim: claim.to_string(),
                    path: path.trim_matches('/').to_string(),
                })
            }
            _ => Err(bad("the scheme must be hf://, s3:// or pvc://")),
        }
    }
}

impl ModelSource {
    /// Whether the files are downloaded (`hf://`, `s3://`) rather than mounted (`pvc://`).
    pub fn is_fetched(&self) -> bool {
        !matches!(self, ModelSource::Pvc { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_schemes() {
        assert_eq!(
            ModelSource::parse("hf://Qwen/Qwen3-8B@v1.0").unwrap(),
            ModelSource::Hf {
                repo: "Qwen/Qwen3-8B".into(),
                revision: "v1.0".into()
            }
        );
        assert_eq!(
            ModelSource::parse("hf://gpt2").unwrap(),
            ModelSource::Hf {
                repo: "gpt2".into(),
                revision: "main".into()
            }
        );
        assert_eq!(
            ModelSource::parse("s3://models/qwen/8b/").unwrap(),
            ModelSource::S3 {
                bucket: "models".into(),
                prefix: "qwen/8b".into()
            }
        );
        assert_eq!(
            ModelSource::parse("pvc://weights/base").unwrap(),
            ModelSource::Pvc {
                claim: "weights".into(),
                path: "base".into()
            }
        );
        for bad in [
            "http://x/y",
            "hf://",
            "hf://a/b/c",
            "hf://a/b@",
            "hf://a/../b",
            "s3://A_B/x",
            "s3://bk/../x",
            "pvc:///x",
            "models/x",
            "hf://a b/c",
        ] {
            assert!(ModelSource::parse(bad).is_err(), "{bad}");
        }
    }
}
