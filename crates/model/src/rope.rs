//! Rotary position embeddings with the scalings transformers implements for Llama and Qwen
//! checkpoints: `default`, `linear`, `dynamic` (NTK), `llama3` and `yarn`, computed as
//! transformers' `modeling_rope_utils` computes the inverse frequencies and the attention
//! scaling (which multiplies cos and sin).
//!
//! The parameters come from `config.json`: transformers 5's `rope_parameters`
//! (`{"rope_type", "rope_theta", "factor", ...}`) or the older `rope_scaling` dict (`"type"` or
//! `"rope_type"`) next to a top-level `rope_theta`. As in transformers, `rope_scaling` wins when
//! both are present and the dict's own `rope_theta` wins over the top-level one.

use candle_core::{DType, Device, Tensor};
use serde_json::{Map, Value};

use super::{ModelConfig, ModelError};

/// The RoPE variant of a model.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// Position interpolation: every inverse frequency divided by `factor`.
    Linear {
        /// Scale factor.
        factor: f64,
    },
    /// Dynamic NTK: beyond `max_position_embeddings` the base grows with the sequence length.
    /// As transformers does, each forward pass uses the length it reaches (`last position + 1`)
    /// for its new queries and keys; keys already cached keep the frequencies they were
    /// rotated with. A prompt prefilled in chunks past the window therefore follows each
    /// chunk's end (as transformers would if fed the same chunks); one-chunk prefill (the
    /// engine's default `prefill_chunk` of 512) equals transformers' `generate`.
    Dynamic {
        /// Scale factor.
        factor: f64,
    },
    /// Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
    Llama3 {
        /// Scale factor.
        factor: f64,
        /// Wavelengths above `original / low_freq_factor` are scaled.
        low_freq_factor: f64,
        /// Wavelengths below `original / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// Pre-training context length.
        original_max: f64,
    },
    /// YaRN: per-dimension blend of interpolation and extrapolation, cos/sin scaled by the
    /// attention factor.
    Yarn {
        /// Scale factor.
        factor: f64,
        /// Pre-training context length.
        original_max: f64,
        /// Multiplies cos and sin.
        attention_factor: f64,
        /// Rotations where extrapolation ends.
        beta_fast: f64,
        /// Rotations where interpolation starts.
        beta_slow: f64,
        /// Round the correction range to whole dimensions.
        truncate: bool,
    },
}

/// RoPE parameters of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    /// Base.
    pub theta: f64,
    /// Variant.
    pub scaling: RopeScaling,
    /// Rotary dimension (the head size).
    pub dim: usize,
}

fn num(d: &Map<String, Value>, key: &str) -> Option<f64> {
    d.get(key).and_then(Value::as_f64)
}

/// What the config says of rotary positions, read here so that the config itself knows
/// nothing of RoPE's rules.
impl ModelConfig {
    /// RoPE base: the RoPE dict's `rope_theta`, else the top-level one, else 10000.
    pub fn rope_theta(&self) -> f64 {
        self.rope()
            .map(|r| r.theta)
            .unwrap_or(self.rope_theta.unwrap_or(10_000.0))
    }
    /// RoPE base and scaling (`rope_scaling` or `rope_parameters`), as transformers reads them.
    pub fn rope(&self) -> Result<Rope, ModelError> {
        Rope::from_config(self)
    }
    /// Longest sequence the model accepts: `max_position_embeddings`, stretched by `linear`,
    /// `dynamic` and `yarn` RoPE scaling (see [`Rope::max_positions`]).
    pub fn max_positions(&self) -> usize {
        self.rope()
            .map(|r| r.max_positions(self.max_position_embeddings))
            .unwrap_or(self.max_position_embeddings)
    }
}

/// The dict transformers would read: `rope_scaling` when set, else `rope_parameters`; a dict
/// nested by layer type (`{"full_attention": {...}}`) is accepted when every layer type has the
/// same parameters.
fn rope_dict(cfg: &ModelConfig) -> Result<Map<String, Value>, ModelError> {
    let pick = |v: &Option<Value>| match v {
        Some(Value::Object(m)) if !m.is_empty() => Some(m.clone()),
        _ => None,
    };
    let Some(d) = pick(&cfg.rope_scaling).or_else(|| pick(&cfg.rope_parameters)) else {
        return Ok(Map::new());
    };
    let nested: Vec<&Value> = d.values().filter(|v| v.is_object()).collect();
    if nested.is_empty() {
        return Ok(d);
    }
    if nested.len() != d.len() || nested.windows(2).any(|w| w[0] != w[1]) {
        return Err(ModelError::Config(
            "RoPE parameters that differ per layer type are not supported".into(),
        ));
    }
    Ok(nested[0].as_object().cloned().unwrap_or_default())
}

impl Rope {
    /// Reads and checks the RoPE parameters of a config.
    pub fn from_config(cfg: &ModelConfig) -> Result<Self, ModelError> {
        let d = rope_dict(cfg)?;
        let theta = num(&d, "rope_theta").or(cfg.rope_theta).unwrap_or(10_000.0);
        let partial = num(&d, "partial_rotary_factor")
            .or(cfg.partial_rotary_factor)
            .unwrap_or(1.0);
        if partial != 1.0 {
            return Err(ModelError::Config(format!(
                "partial_rotary_factor {partial} is not supported (RoPE on the whole head only)"
            )));
        }
        let kind = d
            .get("rope_type")
            .or_else(|| d.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default")
            .to_string();
        let factor = || {
            num(&d, "factor").ok_or_else(|| {
                ModelError::Config(format!("rope type {kind:?} needs a numeric \"factor\""))
            })
        };
        // transformers: a top-level `original_max_position_embeddings` (Phi-3 style) wins over
        // the dict's, which defaults to `max_position_embeddings`.
        let original_max = cfg
            .original_max_position_embeddings
            .map(|v| v as f64)
            .or_else(|| num(&d, "original_max_position_embeddings"))
            .unwrap_or(cfg.max_position_embeddings as f64);
        let scaling = match kind.as_str() {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear { factor: factor()? },
            "dynamic" => RopeScaling::Dynamic { factor: factor()? },
            "llama3" => {
                let need = |k: &str| {
                    num(&d, k).ok_or_else(|| {
                        ModelError::Config(format!("rope type \"llama3\" needs a numeric {k:?}"))
                    })
                };
                let (low, high) = (need("low_freq_factor")?, need("high_freq_factor")?);
                if high <= low {
                    return Err(ModelError::Config(format!(
                        "rope type \"llama3\": high_freq_factor {high} must exceed low_freq_factor {low}"
                    )));
                }
                RopeScaling::Llama3 {
                    factor: factor()?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max,
                }
            }
            "yarn" => {
                let factor = num(&d, "factor")
                    .unwrap_or(cfg.max_position_embeddings as f64 / original_max);
                let mscale = |scale: f64, m: f64| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * scale.ln() + 1.0
                    }
                };
                let attention_factor = match num(&d, "attention_factor") {
                    Some(a) => a,
                    None => match (num(&d, "mscale"), num(&d, "mscale_all_dim")) {
                        (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                            mscale(factor, m) / mscale(factor, all)
                        }
                        _ => mscale(factor, 1.0),
                    },
                };
                // transformers: `get("beta_fast") or 32` (0 and null mean the default too).
                let or = |k: &str, default: f64| num(&d, k).filter(|v| *v != 0.0).unwrap_or(default);
                RopeScaling::Yarn {
                    factor,
                    original_max,
                    attention_factor,
                    beta_fast: or("beta_fast", 32.0),
                    beta_slow: or("beta_slow", 1.0),
                    truncate: d.get("truncate").and_then(Value::as_bool).unwrap_or(true),
                }
            }
            other => {
                return Err(ModelError::Config(format!(
                    "rope type {other:?} is not supported (mole runs default, linear, dynamic, llama3 and yarn)"
                )))
            }
        };
        if let RopeScaling::Linear { factor }
        | RopeScaling::Dynamic { factor }
        | RopeScaling::Llama3 { factor, .. }
        | RopeScaling::Yarn { factor, .. } = &scaling
        {
            if !(factor.is_finite() && *factor > 0.0) {
                return Err(ModelError::Config(format!(
                    "rope type {kind:?}: factor {factor} must be a positive number"
                )));
            }
        }
        if theta.is_nan() || theta <= 1.0 {
            return Err(ModelError::Config(format!(
                "rope_theta {theta} must be > 1"
            )));
        }
        Ok(Self {
            theta,
            scaling,
            dim: cfg.head_dim(),
        })
    }

    /// Positions the model accepts, as vLLM derives them: `max_position_embeddings` times the
    /// factor for `linear` and `dynamic`, `original × factor` for `yarn` (never less than
    /// `max_position_embeddings`), `max_position_embeddings` otherwise.
    pub fn max_positions(&self, max_position_embeddings: usize) -> usize {
        let scaled = |x: f64| (x.floor() as usize).max(max_position_embeddings);
        match &self.scaling {
            RopeScaling::Linear { factor } | RopeScaling::Dynamic { factor } => {
                scaled(max_position_embeddings as f64 * factor)
            }
            RopeScaling::Yarn {
                factor,
                original_max,
                ..
            } => scaled(original_max * factor),
            RopeScaling::Default | RopeScaling::Llama3 { .. } => max_position_embeddings,
        }
    }

    /// `base^(-2i/dim)` for `i < dim/2`.
    fn plain(&self, base: f64) -> Vec<f64> {
        let dim = self.dim as f64;
        (0..self.dim / 2)
            .map(|i| 1.0 / base.powf(2.0 * i as f64 / dim))
            .collect()
    }

    /// Inverse frequencies (`dim/2` of them) and the factor on cos/sin. `seq_len` only matters
    /// to `dynamic`: the sequence length the pass reaches, against `max_position_embeddings`.
    pub fn inv_freq(&self, seq_len: usize, max_position_embeddings: usize) -> (Vec<f64>, f64) {
        let dim = self.dim as f64;
        match &self.scaling {
            RopeScaling::Default => (self.plain(self.theta), 1.0),
            RopeScaling::Linear { factor } => (
                self.plain(self.theta).iter().map(|f| f / factor).collect(),
                1.0,
            ),
            RopeScaling::Dynamic { factor } => {
                let max = max_position_embeddings as f64;
                let seq = (seq_len as f64).max(max);
                let base =
                    self.theta * ((factor * seq / max) - (factor - 1.0)).powf(dim / (dim - 2.0));
                (self.plain(base), 1.0)
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max,
            } => {
                let low_wavelen = original_max / low_freq_factor;
                let high_wavelen = original_max / high_freq_factor;
                let inv = self
                    .plain(self.theta)
                    .into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (original_max / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect();
                (inv, 1.0)
            }
            RopeScaling::Yarn {
                factor,
                original_max,
                attention_factor,
                beta_fast,
                beta_slow,
                truncate,
            } => {
                let base = self.theta;
                let correction_dim = |rotations: f64| {
                    dim * (original_max / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * base.ln())
                };
                let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let mut high = high.min(dim - 1.0);
                if low == high {
                    high += 0.001; // transformers: no division by zero
                }
                let inv = self
                    .plain(base)
                    .into_iter()
                    .enumerate()
                    .map(|(i, extrapolated)| {
                        let interpolated = extrapolated / factor;
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let keep = 1.0 - ramp;
                        interpolated * (1.0 - keep) + extrapolated * keep
                    })
                    .collect();
                (inv, *attention_factor)
            }
        }
    }

    /// Whether the frequencies depend on the sequence length (`dynamic`).
    pub fn is_dynamic(&self) -> bool {
        matches!(self.scaling, RopeScaling::Dynamic { .. })
    }
}

/// cos/sin `[t, head_dim/2]` of HF's non-interleaved rotary embedding for positions
/// `start..start + t`, computed as transformers does: f32 angles `position × inv_freq`, cos and
/// sin times the attention scaling (YaRN), then cast to the model's dtype. The frequencies of
/// dynamic NTK use the length this span reaches.
// The table is made at load; a step computes a span only past the table (dynamic NTK beyond
// the original window), rare enough that its upload is not packed.
#[allow(clippy::disallowed_methods)]
fn rope_cos_sin(
    rope: &Rope,
    original: usize,
    start: usize,
    t: usize,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (inv, scale) = rope.inv_freq(start + t, original);
    let half = inv.len();
    let inv: Vec<f32> = inv.into_iter().map(|f| f as f32).collect();
    let inv = Tensor::from_vec(inv, (1, half), device)?;
    let pos = Tensor::arange(start as u32, (start + t) as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((t, 1))?;
    let freqs = pos.broadcast_mul(&inv)?;
    let (mut cos, mut sin) = (freqs.cos()?, freqs.sin()?);
    if scale != 1.0 {
        cos = (cos * scale)?;
        sin = (sin * scale)?;
    }
    Ok((cos.to_dtype(dtype)?, sin.to_dtype(dtype)?))
}

/// Per rotary frequency (interleaved M-RoPE, see [`super::VisionSpec::mrope_section`]), 1
/// where it follows time, height, width: `[1, head_dim/2]` each.
#[allow(clippy::disallowed_methods)] // made once, at load
fn mrope_masks(
    sections: [usize; 3],
    dtype: DType,
    device: &Device,
) -> candle_core::Result<[Tensor; 3]> {
    let half: usize = sections.iter().sum();
    let axis = |j: usize| -> usize {
        match j % 3 {
            1 if j < 3 * sections[1] => 1,
            2 if j < 3 * sections[2] => 2,
            _ => 0,
        }
    };
    let mask = |a: usize| -> candle_core::Result<Tensor> {
        let v: Vec<f32> = (0..half)
            .map(|j| f32::from(u8::from(axis(j) == a)))
            .collect();
        Tensor::from_vec(v, (1, half), device)?.to_dtype(dtype)
    };
    Ok([mask(0)?, mask(1)?, mask(2)?])
}

/// A decoder's rotary tables: cos/sin `[positions, head_dim/2]` in the compute dtype, made at
/// load, and with M-RoPE the masks that give each frequency its axis. Both step backends build
/// their batches' cos/sin from them.
pub(super) struct RotaryTable {
    rope: Rope,
    /// `max_position_embeddings`: the window dynamic NTK grows past.
    original: usize,
    cos: Tensor,
    sin: Tensor,
    /// M-RoPE: per rotary frequency, 1 where it follows time, height, width (`[1, head_dim/2]`
    /// each, in the compute dtype).
    mrope: Option<[Tensor; 3]>,
    dtype: DType,
    device: Device,
}

impl RotaryTable {
    /// The tables of `cfg`'s RoPE in `dtype` on `device`.
    pub(super) fn new(
        cfg: &ModelConfig,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let rope = cfg.rope()?;
        // Dynamic NTK frequencies depend on the length a pass reaches: the table covers the
        // original window, longer passes compute theirs (see `span`).
        let table_len = if rope.is_dynamic() {
            cfg.max_position_embeddings
        } else {
            cfg.max_positions()
        };
        let original = cfg.max_position_embeddings;
        let (cos, sin) = rope_cos_sin(&rope, original, 0, table_len, dtype, device)?;
        let mrope = match &cfg.vision {
            Some(v) => Some(mrope_masks(v.mrope_section, dtype, device)?),
            None => None,
        };
        Ok(Self {
            rope,
            original,
            cos,
            sin,
            mrope,
            dtype,
            device: device.clone(),
        })
    }

    /// Positions the table holds.
    pub(super) fn len(&self) -> candle_core::Result<usize> {
        self.cos.dim(0)
    }

    /// cos/sin `[tokens, head_dim/2]` at `time` (and with M-RoPE the spatial positions), rows
    /// of the table gathered by position: a frequency takes the angle of its axis's position.
    pub(super) fn at(
        &self,
        time: &Tensor,
        spatial: Option<(&Tensor, &Tensor)>,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        match (spatial, &self.mrope) {
            (Some((h, w)), Some([mt, mh, mw])) => {
                let mix = |table: &Tensor| -> candle_core::Result<Tensor> {
                    let t = table.index_select(time, 0)?.broadcast_mul(mt)?;
                    let h = table.index_select(h, 0)?.broadcast_mul(mh)?;
                    let w = table.index_select(w, 0)?.broadcast_mul(mw)?;
                    (t + h)? + w
                };
                Ok((mix(&self.cos)?, mix(&self.sin)?))
            }
            _ => Ok((
                self.cos.index_select(time, 0)?,
                self.sin.index_select(time, 0)?,
            )),
        }
    }

    /// cos/sin `[tokens, head_dim/2]` of rows starting at `starts` with `lens` new tokens,
    /// row by row (the host path, and dynamic-NTK rows past the table).
    // The host path, and dynamic-NTK rows past the table (rare: a step past the original
    // window), concatenate per-row cos/sin.
    #[allow(clippy::disallowed_methods)]
    pub(super) fn rows(
        &self,
        starts: &[usize],
        lens: &[usize],
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (cos, sin): (Vec<Tensor>, Vec<Tensor>) = starts
            .iter()
            .zip(lens)
            .map(|(&s, &t)| self.span(s, t))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .unzip();
        Ok((Tensor::cat(&cos, 0)?, Tensor::cat(&sin, 0)?))
    }

    /// cos/sin `[t, head_dim/2]` for positions `start..start + t`: rows of the table, or for
    /// a dynamic-NTK pass beyond the original window, frequencies for the length it reaches
    /// (transformers recomputes them whenever a pass grows past what it has seen).
    fn span(&self, start: usize, t: usize) -> candle_core::Result<(Tensor, Tensor)> {
        if start + t > self.cos.dim(0)? {
            return rope_cos_sin(
                &self.rope,
                self.original,
                start,
                t,
                self.dtype,
                &self.device,
            );
        }
        Ok((self.cos.narrow(0, start, t)?, self.sin.narrow(0, start, t)?))
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn cfg(extra: Value) -> ModelConfig {
        let mut v = serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "rms_norm_eps": 1e-6,
            "vocab_size": 16, "max_position_embeddings": 128,
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn legacy_and_v5_forms_read_the_same() {
        let legacy = cfg(serde_json::json!({"rope_theta": 5e5,
            "rope_scaling": {"type": "linear", "factor": 2.0}}));
        let v5 = cfg(serde_json::json!({
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}));
        let a = Rope::from_config(&legacy).unwrap();
        assert_eq!(a, Rope::from_config(&v5).unwrap());
        assert_eq!(a.theta, 5e5);
        assert_eq!(a.max_positions(128), 256);
        // Nested per layer type, all alike.
        let nested = cfg(serde_json::json!({"rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}}));
        assert_eq!(a, Rope::from_config(&nested).unwrap());
    }

    #[test]
    fn yarn_defaults_follow_transformers() {
        let c = cfg(
            serde_json::json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 32}}),
        );
        let r = Rope::from_config(&c).unwrap();
        let RopeScaling::Yarn {
            attention_factor, ..
        } = r.scaling
        else {
            panic!("{r:?}")
        };
        assert!((attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
        assert_eq!(r.max_positions(128), 128);
        assert_eq!(r.max_positions(40), 128);
        // Dynamic at or below the original length is plain RoPE.
        let d = Rope::from_config(&cfg(serde_json::json!({
            "rope_scaling": {"type": "dynamic", "factor": 2.0}})))
        .unwrap();
        let plain = Rope::from_config(&cfg(serde_json::json!({}))).unwrap();
        assert_eq!(d.inv_freq(100, 128), plain.inv_freq(100, 128));
        assert_ne!(d.inv_freq(129, 128), plain.inv_freq(129, 128));
    }

    /// The `rope_scaling` GGUF metadata becomes (see `mole_formats::gguf`) is one the decoder
    /// takes: positions stretched from 32768 to 4 × 32768.
    #[test]
    fn gguf_yarn_scaling_stretches_the_window() {
        let cfg = crate::ModelConfig::from_json(serde_json::json!({
            "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "rms_norm_eps": 1e-6,
            "vocab_size": 16, "max_position_embeddings": 32768,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 32768}
        }))
        .unwrap();
        assert_eq!(cfg.max_positions(), 131072);
    }

    #[test]
    fn unknown_and_incomplete_scalings_are_refused_by_name() {
        for (extra, want) in [
            (
                serde_json::json!({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}),
                "rope type \"longrope\" is not supported",
            ),
            (
                serde_json::json!({"rope_parameters": {"rope_type": "su"}}),
                "rope type \"su\" is not supported",
            ),
            (
                serde_json::json!({"rope_scaling": {"type": "linear"}}),
                "needs a numeric \"factor\"",
            ),
            (
                serde_json::json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
                "needs a numeric \"low_freq_factor\"",
            ),
            (
                serde_json::json!({"partial_rotary_factor": 0.5}),
                "partial_rotary_factor",
            ),
        ] {
            let e = Rope::from_config(&cfg(extra)).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
    }
}
