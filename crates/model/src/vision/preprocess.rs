//! Images as Qwen-VL models take them, computed as transformers' Qwen2-VL image processor
//! computes them: resized to multiples of `patch_size × merge_size` within a pixel budget,
//! keeping the aspect ratio ("smart resize"), with a bicubic filter; scaled to [0, 1] and
//! normalized per channel; cut into `patch_size` squares repeated `temporal_patch_size` times
//! (an image is a one-frame video), in spatial-merge-block order. The processor has two
//! backends whose resizes round differently, and both are here, each equal to its own to the
//! last bit, so the vision tower sees what the model was trained on:
//! - torchvision (transformers 5's default, what vLLM serves Qwen-VL models with): torch's
//!   antialiased bicubic over 8-bit pixels, whose weights are 16-bit integers at as many bits
//!   as the largest fits, horizontal pass first; then one fused rescale-and-normalize in f32;
//! - PIL (Qwen's `qwen-vl-utils`, transformers 4's default): Pillow's bicubic with 22-bit
//!   weights, in Pillow's order of passes; rescaled in f64, normalized in f32.

use mole_api::ImageProcessor;
use serde::Deserialize;

/// Why an image cannot be preprocessed. Stable names via [`PreprocessError::code`].
#[derive(Debug, thiserror::Error)]
pub enum PreprocessError {
    /// Too thin or too wide for the processor (it refuses a ratio over 200).
    #[error("image of {width}×{height} pixels: the aspect ratio must be at most 200")]
    AspectRatio {
        /// Width.
        width: usize,
        /// Height.
        height: usize,
    },
    /// No pixels.
    #[error("image has no pixels")]
    Empty,
}

impl PreprocessError {
    /// Stable name (metric label, JSON code).
    pub fn code(&self) -> &'static str {
        match self {
            PreprocessError::AspectRatio { .. } => "image_aspect_ratio",
            PreprocessError::Empty => "image_empty",
        }
    }
}

/// `preprocessor_config.json`'s fields the processor reads.
#[derive(Debug, Clone, Deserialize)]
pub struct ProcessorConfig {
    /// Side of a square patch, in pixels.
    #[serde(default = "default_patch")]
    pub patch_size: usize,
    /// Frames per patch (an image repeats its one frame).
    #[serde(default = "default_temporal")]
    pub temporal_patch_size: usize,
    /// Patches merged into one token per side.
    #[serde(default = "default_merge")]
    pub merge_size: usize,
    /// Per-channel mean after scaling to [0, 1].
    #[serde(default = "default_half")]
    pub image_mean: [f32; 3],
    /// Per-channel standard deviation after scaling to [0, 1].
    #[serde(default = "default_half")]
    pub image_std: [f32; 3],
    /// Pixel budget: `shortest_edge` is the least, `longest_edge` the most.
    #[serde(default)]
    pub size: Option<PixelBudget>,
    /// The budget's older spelling.
    #[serde(default)]
    pub min_pixels: Option<usize>,
    /// The budget's older spelling.
    #[serde(default)]
    pub max_pixels: Option<usize>,
    /// Which backend's arithmetic the values follow: the pool's choice, not the file's.
    #[serde(skip)]
    pub backend: ImageProcessor,
}

/// The processor's pixel budget.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct PixelBudget {
    /// Fewest pixels after resizing.
    pub shortest_edge: usize,
    /// Most pixels after resizing.
    pub longest_edge: usize,
}

fn default_patch() -> usize {
    16
}
fn default_temporal() -> usize {
    2
}
fn default_merge() -> usize {
    2
}
fn default_half() -> [f32; 3] {
    [0.5; 3]
}

impl Default for ProcessorConfig {
    /// Qwen3-VL's own settings.
    fn default() -> Self {
        Self {
            patch_size: 16,
            temporal_patch_size: 2,
            merge_size: 2,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            size: Some(PixelBudget {
                shortest_edge: 65_536,
                longest_edge: 16_777_216,
            }),
            min_pixels: None,
            max_pixels: None,
            backend: ImageProcessor::default(),
        }
    }
}

impl ProcessorConfig {
    /// The least and most pixels an image is resized into.
    pub fn pixel_budget(&self) -> (usize, usize) {
        let b = self.size.unwrap_or(PixelBudget {
            shortest_edge: 56 * 56,
            longest_edge: 28 * 28 * 1280,
        });
        (
            self.min_pixels.unwrap_or(b.shortest_edge),
            self.max_pixels.unwrap_or(b.longest_edge),
        )
    }

    /// Values per patch: channels × frames × pixels.
    pub fn patch_len(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}

/// An image cut into patches: `values` is `[patches, patch_len]` row-major, `grid` the
/// patches along time, height and width.
#[derive(Debug, Clone, PartialEq)]
pub struct Patches {
    /// Patch values.
    pub values: Vec<f32>,
    /// (frames, rows, columns) of patches.
    pub grid: [usize; 3],
}

impl Patches {
    /// Tokens the image becomes in the language model (patches merged `merge × merge`).
    pub fn tokens(&self, merge: usize) -> usize {
        self.grid.iter().product::<usize>() / (merge * merge)
    }
}

/// The size an image is resized to: each side a multiple of `factor`, the area within
/// `[min_pixels, max_pixels]`, the aspect ratio kept as closely as that allows (transformers'
/// `smart_resize`, Python's round-half-to-even included).
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize), PreprocessError> {
    if height == 0 || width == 0 {
        return Err(PreprocessError::Empty);
    }
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    if h.max(w) / h.min(w) > 200.0 {
        return Err(PreprocessError::AspectRatio { width, height });
    }
    let mut h_bar = (h / f).round_ties_even() * f;
    let mut w_bar = (w / f).round_ties_even() * f;
    if h_bar * w_bar > max_pixels as f64 {
        let beta = (h * w / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as usize, w_bar as usize))
}

/// Preprocesses an RGB image (`rgb` row-major, 3 bytes a pixel, `width × height`).
pub fn preprocess(
    cfg: &ProcessorConfig,
    rgb: &[u8],
    width: usize,
    height: usize,
) -> Result<Patches, PreprocessError> {
    let (p, m, t) = (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size);
    let (min_pixels, max_pixels) = cfg.pixel_budget();
    let (nh, nw) = smart_resize(height, width, p * m, min_pixels, max_pixels)?;
    let resized = if (nh, nw) == (height, width) {
        rgb.to_vec()
    } else {
        match cfg.backend {
            ImageProcessor::Torchvision => resize_bicubic_torch(rgb, width, height, nw, nh),
            ImageProcessor::Pil => resize_bicubic(rgb, width, height, nw, nh),
        }
    };
    // The PIL backend rescales in f64, then casts to f32 and normalizes in f32; torchvision's
    // fuses both into one normalize in f32 by a mean and deviation scaled by 255 (in f32).
    let fused: [(f32, f32); 3] =
        std::array::from_fn(|c| (cfg.image_mean[c] * 255.0, cfg.image_std[c] * 255.0));
    let scale = 1.0f64 / 255.0;
    let value = |y: usize, x: usize, c: usize| -> f32 {
        let byte = resized[(y * nw + x) * 3 + c];
        match cfg.backend {
            ImageProcessor::Torchvision => (byte as f32 - fused[c].0) / fused[c].1,
            ImageProcessor::Pil => {
                let v = (byte as f64 * scale) as f32;
                (v - cfg.image_mean[c]) / cfg.image_std[c]
            }
        }
    };
    let (gh, gw) = (nh / p, nw / p);
    let mut values = Vec::with_capacity(gh * gw * cfg.patch_len());
    for bh in 0..gh / m {
        for bw in 0..gw / m {
            for mh in 0..m {
                for mw in 0..m {
                    let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                    for c in 0..3 {
                        for _ in 0..t {
                            for py in 0..p {
                                for px in 0..p {
                                    values.push(value(y0 + py, x0 + px, c));
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(Patches {
        values,
        grid: [1, gh, gw],
    })
}

/// Bits of fraction in PIL's fixed-point filter coefficients for 8-bit images.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// PIL's bicubic kernel (`a = -0.5`), support 2.
fn bicubic(x: f64) -> f64 {
    let a = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * a
    } else {
        0.0
    }
}

/// For each output position along an axis of `in_size` inputs resized to `out_size`: the first
/// input it reads and its fixed-point weights (PIL's `precompute_coeffs` and
/// `normalize_coeffs_8bpc`: a downscale widens the kernel by the scale, so it averages).
fn coefficients(in_size: usize, out_size: usize) -> Vec<(usize, Vec<i32>)> {
    let scale = in_size as f64 / out_size as f64;
    let filter_scale = scale.max(1.0);
    let support = 2.0 * filter_scale;
    let inverse = 1.0 / filter_scale;
    (0..out_size)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            // C's (int) truncates toward zero, then clamps.
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let w: Vec<f64> = (xmin..xmax)
                .map(|x| bicubic((x as f64 - center + 0.5) * inverse))
                .collect();
            let total: f64 = w.iter().sum();
            let fixed = w
                .iter()
                .map(|&k| {
                    let k = if total != 0.0 { k / total } else { k };
                    let v = k * (1u32 << PRECISION_BITS) as f64;
                    if v < 0.0 {
                        (v - 0.5) as i32
                    } else {
                        (v + 0.5) as i32
                    }
                })
                .collect();
            (xmin, fixed)
        })
        .collect()
}

/// A sum of `bits` fraction bits back to a byte.
fn clip(sum: i64, bits: u32) -> u8 {
    (sum >> bits).clamp(0, 255) as u8
}

/// torch's antialiased bicubic weights for its 8-bit kernel (`_upsample_bicubic2d_aa` on CPU):
/// Pillow's kernel and bounds in f64, then rounded to 16-bit integers at the most fraction
/// bits (below 22) at which the axis's largest weight still fits; returns those bits.
fn coefficients_torch(in_size: usize, out_size: usize) -> (Vec<(usize, Vec<i32>)>, u32) {
    let scale = in_size as f64 / out_size as f64;
    let (support, inverse) = if scale >= 1.0 {
        (2.0 * scale, 1.0 / scale)
    } else {
        (2.0, 1.0)
    };
    // torch sizes its weight rows by the support rounded up in f32.
    let max_taps = (support as f32).ceil() as i64 * 2 + 1;
    let mut largest = 0f64;
    let rows: Vec<(usize, Vec<f64>)> = (0..out_size)
        .map(|i| {
            let center = scale * (i as f64 + 0.5);
            let xmin = ((center - support + 0.5) as i64).max(0);
            let taps =
                (((center + support + 0.5) as i64).min(in_size as i64) - xmin).clamp(0, max_taps);
            let mut w: Vec<f64> = (0..taps)
                .map(|j| bicubic(((j + xmin) as f64 - center + 0.5) * inverse))
                .collect();
            let total: f64 = w.iter().sum();
            if total != 0.0 {
                for k in &mut w {
                    *k /= total;
                    largest = largest.max(*k);
                }
            }
            (xmin as usize, w)
        })
        .collect();
    let mut bits = 0u32;
    while bits < 22 && ((0.5 + largest * (1u32 << (bits + 1)) as f64) as i64) < 1 << 15 {
        bits += 1;
    }
    let fixed = rows
        .into_iter()
        .map(|(xmin, w)| {
            let k = w
                .iter()
                .map(|&k| {
                    let v = k * (1u32 << bits) as f64;
                    // The weights are int16 in torch's kernel.
                    (if v < 0.0 { v - 0.5 } else { v + 0.5 }) as i16 as i32
                })
                .collect();
            (xmin, k)
        })
        .collect();
    (fixed, bits)
}

/// torchvision's `resize(BICUBIC, antialias=True)` of an 8-bit RGB image on the CPU (torch's
/// AVX2 kernel for 8-bit images, which transformers' fast processor runs): the horizontal pass
/// over every row into 8-bit rows, then the vertical pass, each rounded to bytes.
pub fn resize_bicubic_torch(rgb: &[u8], w: usize, h: usize, nw: usize, nh: usize) -> Vec<u8> {
    let mid = if nw == w {
        rgb.to_vec()
    } else {
        let (k, bits) = coefficients_torch(w, nw);
        convolve_rows(rgb, w, 0..h, &k, bits)
    };
    if nh == h {
        return mid;
    }
    let (k, bits) = coefficients_torch(h, nh);
    convolve_columns(&mid, nw, &k, 0, bits)
}

/// PIL's `Image.resize(BICUBIC)` of an RGB image: two passes, each a fixed-point convolution
/// rounded to bytes, so the result equals Pillow's byte for byte. The order of the passes
/// changes the bytes, so it is Pillow's (`ImagingResampleInner`, Pillow 13): horizontal first,
/// unless the height shrinks by more than twice what the width shrinks (a width that grows
/// while the height shrinks included), where the vertical pass runs first over whole columns.
pub fn resize_bicubic(rgb: &[u8], w: usize, h: usize, nw: usize, nh: usize) -> Vec<u8> {
    let horizontal = coefficients(w, nw);
    let vertical = coefficients(h, nh);
    let shrink_h = h as i64 - nh as i64;
    let shrink_w = w as i64 - nw as i64;
    if shrink_h > 0 && shrink_h > shrink_w * 2 {
        let mid = convolve_columns(rgb, w, &vertical, 0, PRECISION_BITS);
        return if nw == w {
            mid
        } else {
            convolve_rows(&mid, w, 0..nh, &horizontal, PRECISION_BITS)
        };
    }
    // The rows the vertical pass reads: from the first row of the first output row's kernel
    // to the last of the last's (Pillow resamples only those horizontally).
    let first = vertical.first().map_or(0, |(y, _)| *y);
    let last = vertical.last().map_or(0, |(y, k)| y + k.len());
    let mid = if nw == w {
        rgb[first * w * 3..last * w * 3].to_vec()
    } else {
        convolve_rows(rgb, w, first..last, &horizontal, PRECISION_BITS)
    };
    if nh == h {
        return mid;
    }
    convolve_columns(&mid, nw, &vertical, first, PRECISION_BITS)
}

/// Rows `rows` of `src` (`w` pixels wide) resampled to `coeffs.len()` pixels each, by weights
/// of `bits` fraction bits.
fn convolve_rows(
    src: &[u8],
    w: usize,
    rows: std::ops::Range<usize>,
    coeffs: &[(usize, Vec<i32>)],
    bits: u32,
) -> Vec<u8> {
    let half = 1i64 << (bits - 1);
    let nw = coeffs.len();
    let mut out = vec![0u8; rows.len() * nw * 3];
    for (r, y) in rows.enumerate() {
        let row = &src[y * w * 3..(y + 1) * w * 3];
        for (xx, (xmin, k)) in coeffs.iter().enumerate() {
            for c in 0..3 {
                let sum = k.iter().enumerate().fold(half, |s, (i, &k)| {
                    s + row[(xmin + i) * 3 + c] as i64 * k as i64
                });
                out[(r * nw + xx) * 3 + c] = clip(sum, bits);
            }
        }
    }
    out
}

/// `src` (`width` pixels wide, its first row being row `first` of the image the kernels'
/// bounds index) resampled to `coeffs.len()` rows, by weights of `bits` fraction bits.
fn convolve_columns(
    src: &[u8],
    width: usize,
    coeffs: &[(usize, Vec<i32>)],
    first: usize,
    bits: u32,
) -> Vec<u8> {
    let half = 1i64 << (bits - 1);
    let mut out = vec![0u8; coeffs.len() * width * 3];
    for (yy, (ymin, k)) in coeffs.iter().enumerate() {
        for x in 0..width * 3 {
            let sum = k.iter().enumerate().fold(half, |s, (i, &k)| {
                s + src[(ymin - first + i) * width * 3 + x] as i64 * k as i64
            });
            out[yy * width * 3 + x] = clip(sum, bits);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_keeps_multiples_within_the_budget() {
        // Round half to even, as Python: 48 / 32 = 1.5 → 2, 80 / 32 = 2.5 → 2.
        assert_eq!(smart_resize(48, 80, 32, 0, 1 << 30).unwrap(), (64, 64));
        // Over the budget: scaled down, floored to multiples.
        let (h, w) = smart_resize(1080, 1920, 32, 0, 512 * 512).unwrap();
        assert!(h * w <= 512 * 512 && h % 32 == 0 && w % 32 == 0, "{h}×{w}");
        // Under it: scaled up, ceiled.
        let (h, w) = smart_resize(10, 10, 32, 64 * 64, 1 << 30).unwrap();
        assert!(h * w >= 64 * 64 && h % 32 == 0, "{h}×{w}");
        assert!(matches!(
            smart_resize(1, 300, 32, 0, 1 << 30),
            Err(PreprocessError::AspectRatio { .. })
        ));
    }
}
