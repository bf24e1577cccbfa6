//! `bench decode`'s image case: time to first token for one screenshot on a synthetic Qwen3-VL
//! (the decode case's text model, with a vision tower of Qwen3-VL-8B's shape unless told
//! otherwise), split into what a request goes through (PNG decode and preprocessing on the
//! caller's thread, the vision tower, the prefill of the text and image tokens with the first
//! token read back) and set beside the prefill of a text prompt of the same length and of the
//! text alone, measured in the same run.

use std::io::Cursor;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};

use super::decode::DecodeBenchArgs;
use super::synthetic::synthetic_json;
use mole_model::vision::preprocess::{preprocess, ProcessorConfig};
use mole_model::vision::{mrope_positions, ImageEmbeds};
use mole_model::{argmax, Decoder, ModelConfig, Row, RowVision, SeqCache};

const IMAGE_TOKEN: u32 = 31_990;
/// Text tokens before and after the image (a short instruction, as the seeds send).
const TEXT: usize = 16;

/// A synthetic Qwen3-VL: the decode case's text model, M-RoPE sections in Qwen3-VL's
/// proportions, and a vision tower of `depth` blocks of width `hidden` (Qwen3-VL-8B: 27 and
/// 1152, 16 heads, MLP 4304, DeepStack after blocks 8, 16 and 24).
fn config(args: &DecodeBenchArgs) -> serde_json::Value {
    let mut text = synthetic_json(args.hidden, args.layers);
    text["rope_parameters"] = serde_json::json!({
        "rope_type": "default", "rope_theta": 5_000_000.0,
        "mrope_section": [12, 10, 10], "mrope_interleaved": true,
    });
    text["max_position_embeddings"] = 32_768.into();
    let (d, h) = (args.vision_depth, args.vision_hidden);
    let deepstack: Vec<usize> = [d / 3, 2 * d / 3, d - 3]
        .into_iter()
        .filter(|&i| i < d)
        .collect();
    serde_json::json!({
        "model_type": "qwen3_vl", "tie_word_embeddings": true,
        "image_token_id": IMAGE_TOKEN, "video_token_id": IMAGE_TOKEN + 1,
        "vision_start_token_id": IMAGE_TOKEN + 2, "vision_end_token_id": IMAGE_TOKEN + 3,
        "text_config": text,
        "vision_config": {
            "depth": d, "hidden_size": h, "intermediate_size": h * 4304 / 1152,
            "num_heads": h / 72, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "out_hidden_size": args.hidden,
            "num_position_embeddings": 2304, "deepstack_visual_indexes": deepstack,
            "hidden_act": "gelu_pytorch_tanh",
        },
    })
}

/// A screenshot-like PNG: flat panels, text-like stripes and a gradient.
fn screenshot(w: u32, h: u32) -> anyhow::Result<Vec<u8>> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        let panel = (x / 160 + y / 120) % 3;
        let stripe = (y % 18 < 3 && x % 240 < 200) as u8;
        image::Rgb([
            (40 + panel * 70) as u8 ^ (stripe * 200),
            (x * 255 / w) as u8,
            (y * 255 / h) as u8,
        ])
    });
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png)?;
    Ok(out.into_inner())
}

/// One prefill of `ids` (with `vision`) to its first token, read back.
fn prefill(model: &Decoder, ids: &[u32], vision: Option<RowVision<'_>>) -> anyhow::Result<u32> {
    let mut cache = SeqCache::default();
    let mut rows = [Row {
        tokens: ids,
        cache: &mut cache,
        adapter: None,
        vision,
    }];
    Ok(argmax(&model.forward(&mut rows)?[0])?)
}

/// The fastest of `runs` timings of `f`.
fn best<T>(runs: usize, mut f: impl FnMut() -> anyhow::Result<T>) -> anyhow::Result<Duration> {
    let mut best = Duration::MAX;
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed());
    }
    Ok(best)
}

/// Runs the image case (after the decode case, on its device and dtype).
pub(super) fn run(
    args: &DecodeBenchArgs,
    (w, h): (u32, u32),
    dev: &Device,
    dtype: DType,
) -> anyhow::Result<()> {
    let cfg = ModelConfig::from_json(config(args))?;
    let varmap = VarMap::new();
    let model = Decoder::new(cfg, VarBuilder::from_varmap(&varmap, dtype, dev))?;
    let tower = model
        .vision()
        .ok_or_else(|| anyhow::anyhow!("no vision tower"))?;
    let proc = ProcessorConfig::default();
    let png = screenshot(w, h)?;
    let decode = || -> anyhow::Result<_> {
        let rgb = image::load_from_memory(&png)?.into_rgb8();
        Ok(preprocess(&proc, rgb.as_raw(), w as usize, h as usize)?)
    };
    let patches = decode()?;
    let n = patches.values.len() / proc.patch_len();
    let tokens = patches.tokens(proc.merge_size);
    // Best of 2 to 3: the first run of each shape also warms allocations up.
    let runs = args.rounds.clamp(2, 3);
    let t_decode = best(runs, decode)?;
    let pixels = Tensor::from_vec(patches.values.clone(), (n, proc.patch_len()), dev)?;
    let encode = || -> anyhow::Result<ImageEmbeds> {
        let e = tower.forward(&pixels, &[patches.grid], None)?;
        dev.synchronize()?;
        Ok(e)
    };
    let embeds = encode()?;
    let t_tower = best(runs, encode)?;
    let text: Vec<u32> = (1..=TEXT as u32).collect();
    let mut ids = text.clone();
    ids.push(IMAGE_TOKEN + 2);
    let first = ids.len() as u32;
    ids.extend(std::iter::repeat_n(IMAGE_TOKEN, tokens));
    ids.push(IMAGE_TOKEN + 3);
    ids.extend(&text);
    let (positions, offset) = mrope_positions(&ids, IMAGE_TOKEN, &[patches.grid], 2)?;
    let image_tokens: Vec<(u32, u32)> = (0..tokens as u32).map(|j| (first + j, j)).collect();
    let vision = RowVision {
        positions: &positions,
        image_tokens: &image_tokens,
        embeds: Some(&embeds),
        offset,
    };
    prefill(&model, &ids, Some(vision))?;
    let t_prefill = best(runs, || prefill(&model, &ids, Some(vision)))?;
    let same_len: Vec<u32> = (0..ids.len() as u32).map(|i| 1 + i % 30_000).collect();
    let t_same = best(runs, || prefill(&model, &same_len, None))?;
    let short: Vec<u32> = [text.clone(), text].concat();
    let t_short = best(runs, || prefill(&model, &short, None))?;
    let ttft = t_decode + t_tower + t_prefill;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "\nimage case: one {w}×{h} PNG screenshot → {n} patches, {tokens} image tokens; vision \
         tower {} blocks × {}, text model as above ({:?}), {} tokens prefilled in one pass",
        args.vision_depth,
        args.vision_hidden,
        model.dtype(),
        ids.len()
    );
    let line =
        |what: &str, t: Duration, ratio: &str| println!("  {what:<48} {:>9.1} ms  {ratio}", ms(t));
    line("decode + preprocess (caller's thread)", t_decode, "");
    line("vision tower", t_tower, "");
    line("prefill with the image's embeddings", t_prefill, "");
    line("time to first token", ttft, "");
    line(
        &format!("prefill of {} text tokens (same length)", same_len.len()),
        t_same,
        &format!(
            "image prefill ÷ same-length text {:.2}",
            ms(t_prefill) / ms(t_same)
        ),
    );
    line(
        &format!("prefill of the {} text tokens alone", short.len()),
        t_short,
        &format!("image TTFT ÷ text alone {:.1}", ms(ttft) / ms(t_short)),
    );
    Ok(())
}
