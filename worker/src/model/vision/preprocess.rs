//! Images as Qwen-VL models take them, computed as transformers' Qwen2-VL image processor
//! computes them with its PIL backend (what Qwen's own `qwen-vl-utils` does too): resized to
//! multiples of `patch_size × merge_size` within a pixel budget, keeping the aspect ratio
//! ("smart resize"), with PIL's bicubic filter; scaled to [0, 1] and normalized per channel;
//! cut into `patch_size` squares repeated `temporal_patch_size` times (an image is a one-frame
//! video), in spatial-merge-block order. The values equal the processor's to the last bit,
//! so the vision tower sees what the model was trained on.

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
        resize_bicubic(rgb, width, height, nw, nh)
    };
    // transformers rescales in f64, then casts to f32 and normalizes in f32.
    let scale = 1.0f64 / 255.0;
    let value = |y: usize, x: usize, c: usize| -> f32 {
        let v = (resized[(y * nw + x) * 3 + c] as f64 * scale) as f32;
        (v - cfg.image_mean[c]) / cfg.image_std[c]
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
    (0..out_size)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            // C's (int) truncates toward zero, then clamps.
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let w: Vec<f64> = (xmin..xmax)
                .map(|x| bicubic((x as f64 - center + 0.5) / filter_scale))
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

/// A fixed-point sum back to a byte, as PIL's `clip8`.
fn clip8(sum: i64) -> u8 {
    (sum >> PRECISION_BITS).clamp(0, 255) as u8
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
        let mid = vertical_pass(rgb, w, &vertical, 0);
        return if nw == w {
            mid
        } else {
            horizontal_pass(&mid, w, 0..nh, &horizontal)
        };
    }
    // The rows the vertical pass reads: from the first row of the first output row's kernel
    // to the last of the last's (Pillow resamples only those horizontally).
    let first = vertical.first().map_or(0, |(y, _)| *y);
    let last = vertical.last().map_or(0, |(y, k)| y + k.len());
    let mid = if nw == w {
        rgb[first * w * 3..last * w * 3].to_vec()
    } else {
        horizontal_pass(rgb, w, first..last, &horizontal)
    };
    if nh == h {
        return mid;
    }
    vertical_pass(&mid, nw, &vertical, first)
}

/// Rows `rows` of `src` (`w` pixels wide) resampled to `coeffs.len()` pixels each.
fn horizontal_pass(
    src: &[u8],
    w: usize,
    rows: std::ops::Range<usize>,
    coeffs: &[(usize, Vec<i32>)],
) -> Vec<u8> {
    let half = 1i64 << (PRECISION_BITS - 1);
    let nw = coeffs.len();
    let mut out = vec![0u8; rows.len() * nw * 3];
    for (r, y) in rows.enumerate() {
        let row = &src[y * w * 3..(y + 1) * w * 3];
        for (xx, (xmin, k)) in coeffs.iter().enumerate() {
            for c in 0..3 {
                let sum = k.iter().enumerate().fold(half, |s, (i, &k)| {
                    s + row[(xmin + i) * 3 + c] as i64 * k as i64
                });
                out[(r * nw + xx) * 3 + c] = clip8(sum);
            }
        }
    }
    out
}

/// `src` (`width` pixels wide, its first row being row `first` of the image the kernels'
/// bounds index) resampled to `coeffs.len()` rows.
fn vertical_pass(src: &[u8], width: usize, coeffs: &[(usize, Vec<i32>)], first: usize) -> Vec<u8> {
    let half = 1i64 << (PRECISION_BITS - 1);
    let mut out = vec![0u8; coeffs.len() * width * 3];
    for (yy, (ymin, k)) in coeffs.iter().enumerate() {
        for x in 0..width * 3 {
            let sum = k.iter().enumerate().fold(half, |s, (i, &k)| {
                s + src[(ymin - first + i) * width * 3 + x] as i64 * k as i64
            });
            out[yy * width * 3 + x] = clip8(sum);
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
