//! Images of a request inside the engine: preprocessed at submit (the caller's thread), their
//! placeholders expanded to one token per merged patch block, M-RoPE positions laid out; the
//! vision tower runs once per engine step over the images of every sequence whose prefill
//! starts in it (once per adapter among them that targets the tower), and each prompt chunk
//! then takes its slice of positions and placeholders.

use std::path::Path;

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::api::{EngineError, Image};
use crate::model::vision::preprocess::{self, Patches, ProcessorConfig};
use crate::model::vision::{mrope_positions, ImageEmbeds, VisionTower};
use crate::model::{LoraAdapter, ModelError, VisionSpec};

/// How a vision model takes images: its processor's settings and its placeholder token.
#[derive(Debug, Clone)]
pub(super) struct ImageProcessor {
    cfg: ProcessorConfig,
    image_token: u32,
}

impl ImageProcessor {
    /// The processor of a model directory (`preprocessor_config.json`; Qwen3-VL's settings when
    /// the file is missing), computing as transformers' `backend` does.
    pub(super) fn load(
        dir: &Path,
        spec: &VisionSpec,
        backend: mole_api::ImageProcessor,
    ) -> Result<Self, EngineError> {
        let path = dir.join("preprocessor_config.json");
        let mut cfg: ProcessorConfig = match std::fs::read_to_string(&path) {
            Ok(s) => serde_json::from_str(&s)
                .map_err(|e| EngineError::NotReady(format!("{}: {e}", path.display())))?,
            Err(_) => ProcessorConfig::default(),
        };
        cfg.backend = backend;
        Ok(Self::new(cfg, spec))
    }

    /// A processor with `cfg` for a model of `spec`.
    pub(super) fn new(cfg: ProcessorConfig, spec: &VisionSpec) -> Self {
        Self {
            cfg,
            image_token: spec.image_token_id,
        }
    }

    /// Tokens an image of `width × height` takes.
    pub(super) fn tokens(&self, width: u32, height: u32) -> Result<usize, EngineError> {
        let c = &self.cfg;
        let (min, max) = c.pixel_budget();
        let (h, w) = preprocess::smart_resize(
            height as usize,
            width as usize,
            c.patch_size * c.merge_size,
            min,
            max,
        )
        .map_err(|e| EngineError::InvalidImage(e.to_string()))?;
        Ok(h * w / (c.patch_size * c.merge_size).pow(2))
    }

    /// Whether `ids` holds image placeholders.
    pub(super) fn has_placeholders(&self, ids: &[u32]) -> bool {
        ids.contains(&self.image_token)
    }

    /// The prompt `ids` with each image placeholder expanded to its image's tokens, and what
    /// the decoder needs of the images. Images with the same bytes are preprocessed (and later
    /// encoded) once.
    pub(super) fn prepare(
        &self,
        ids: &[u32],
        images: &[Image],
    ) -> Result<(Vec<u32>, ImagePrompt), EngineError> {
        let placeholders = ids.iter().filter(|&&t| t == self.image_token).count();
        if placeholders != images.len() {
            return Err(EngineError::InvalidImage(format!(
                "the prompt has {placeholders} image placeholders for {} images",
                images.len()
            )));
        }
        // Each image's distinct index, in order of first appearance.
        let mut distinct: Vec<&Image> = Vec::new();
        let which: Vec<usize> = images
            .iter()
            .map(
                |img| match distinct.iter().position(|d| d.digest == img.digest) {
                    Some(u) => u,
                    None => {
                        distinct.push(img);
                        distinct.len() - 1
                    }
                },
            )
            .collect();
        let patches: Vec<Patches> = distinct
            .par_iter()
            .map(|img| {
                preprocess::preprocess(&self.cfg, &img.rgb, img.width as usize, img.height as usize)
                    .map_err(|e| EngineError::InvalidImage(e.to_string()))
            })
            .collect::<Result<_, _>>()?;
        let merge = self.cfg.merge_size;
        let mut first_row = Vec::with_capacity(patches.len());
        let mut rows = 0u32;
        for p in &patches {
            first_row.push(rows);
            rows += p.tokens(merge) as u32;
        }
        let mut expanded = Vec::with_capacity(ids.len() + rows as usize);
        let mut image_tokens = Vec::new();
        let mut next = which.iter();
        for &t in ids {
            if t != self.image_token {
                expanded.push(t);
                continue;
            }
            let u = *next.next().expect("placeholders counted");
            for j in 0..patches[u].tokens(merge) as u32 {
                image_tokens.push((expanded.len() as u32, first_row[u] + j));
                expanded.push(t);
            }
        }
        let grids: Vec<[usize; 3]> = which.iter().map(|&u| patches[u].grid).collect();
        let (positions, offset) = mrope_positions(&expanded, self.image_token, &grids, merge)
            .map_err(|e| EngineError::InvalidImage(e.to_string()))?;
        let patch_len = self.cfg.patch_len();
        Ok((
            expanded,
            ImagePrompt {
                digests: distinct.iter().map(|d| d.digest).collect(),
                first_rows: first_row,
                grids: patches.iter().map(|p| p.grid).collect(),
                pixels: patches.into_iter().flat_map(|p| p.values).collect(),
                patch_len,
                rows: rows as usize,
                positions,
                offset,
                image_tokens,
                embeds: None,
            },
        ))
    }
}

/// A prompt's images as the decoder takes them (a request's choices each hold a copy).
#[derive(Clone)]
pub(super) struct ImagePrompt {
    /// Digests of the distinct images.
    pub(super) digests: Vec<[u8; 32]>,
    /// The first embedding row of each distinct image.
    first_rows: Vec<u32>,
    /// Patch values of the distinct images, `[patches, patch_len]` row-major, in order.
    pixels: Vec<f32>,
    patch_len: usize,
    /// Grids of the distinct images.
    grids: Vec<[usize; 3]>,
    /// Tokens of the distinct images: the rows of their embeddings.
    rows: usize,
    /// M-RoPE position of each prompt token.
    positions: Vec<[u32; 3]>,
    /// Position minus index of the tokens after the prompt.
    offset: i64,
    /// The prompt's placeholder tokens: (index in the prompt, row of the embeddings).
    image_tokens: Vec<(u32, u32)>,
    /// The tower's output, once it ran (kept while the sequence lives: a preempted sequence
    /// recomputes its prompt from it).
    pub(super) embeds: Option<ImageEmbeds>,
}

impl ImagePrompt {
    /// Positions and placeholders (indices relative to `from`) of context tokens
    /// `from..to`; tokens past the prompt (recomputed after a preemption) are text.
    pub(super) fn chunk(&self, from: usize, to: usize) -> Chunk {
        let positions = (from..to)
            .map(|i| {
                self.positions
                    .get(i)
                    .copied()
                    .unwrap_or([(i as i64 + self.offset) as u32; 3])
            })
            .collect();
        let image_tokens = self
            .image_tokens
            .iter()
            .filter(|(i, _)| (from..to).contains(&(*i as usize)))
            .map(|&(i, row)| (i - from as u32, row))
            .collect();
        Chunk {
            positions,
            image_tokens,
        }
    }

    /// What identifies the image content at the placeholders among prompt tokens
    /// `from..to` (prefix caching's block hashes): each one's index, its image's digest and
    /// the image's embedding row it takes.
    pub(super) fn keys_in(
        &self,
        from: usize,
        to: usize,
    ) -> impl Iterator<Item = (u32, [u8; 32], u32)> + '_ {
        // Placeholders are in prompt order.
        let start = self
            .image_tokens
            .partition_point(|(i, _)| (*i as usize) < from);
        self.image_tokens[start..]
            .iter()
            .take_while(move |(i, _)| (*i as usize) < to)
            .map(|&(i, row)| {
                let u = self.first_rows.partition_point(|&r| r <= row) - 1;
                (i, self.digests[u], row - self.first_rows[u])
            })
    }

    /// Where decoding continues: position minus index after the prompt.
    pub(super) fn offset(&self) -> i64 {
        self.offset
    }
}

/// A prompt chunk's share of its images: see [`crate::model::RowVision`].
pub(super) struct Chunk {
    /// M-RoPE position of each of the chunk's tokens.
    pub(super) positions: Vec<[u32; 3]>,
    /// The chunk's placeholders: (index in the chunk, row of the embeddings).
    pub(super) image_tokens: Vec<(u32, u32)>,
}

/// Runs the vision tower over the images of `prompts` not encoded yet, once per adapter among
/// them (once in all when no adapter targets the tower), and hands each prompt its share.
pub(super) fn encode(
    tower: &VisionTower,
    device: &Device,
    prompts: &mut [(&mut ImagePrompt, Option<&LoraAdapter>)],
) -> Result<(), ModelError> {
    let mut todo: Vec<&mut (&mut ImagePrompt, Option<&LoraAdapter>)> = prompts
        .iter_mut()
        .filter(|(p, _)| p.embeds.is_none())
        .collect();
    // An adapter that leaves the tower alone encodes as the base does.
    let key = |a: Option<&LoraAdapter>| a.filter(|a| a.has_vision()).map(|a| a as *const _);
    while let Some((_, first)) = todo.first().map(|(p, a)| (p.patch_len, *a)) {
        let group = key(first);
        let (mine, rest): (Vec<_>, Vec<_>) = todo.into_iter().partition(|(_, a)| key(*a) == group);
        todo = rest;
        encode_group(tower, device, mine, first.filter(|a| a.has_vision()))?;
    }
    Ok(())
}

/// One tower pass over the images of `prompts`, with `adapter`.
fn encode_group(
    tower: &VisionTower,
    device: &Device,
    prompts: Vec<&mut (&mut ImagePrompt, Option<&LoraAdapter>)>,
    adapter: Option<&LoraAdapter>,
) -> Result<(), ModelError> {
    let Some(patch_len) = prompts.first().map(|(p, _)| p.patch_len) else {
        return Ok(());
    };
    let mut pixels = Vec::new();
    let mut grids = Vec::new();
    for (p, _) in &prompts {
        pixels.extend_from_slice(&p.pixels);
        grids.extend_from_slice(&p.grids);
    }
    let n = pixels.len() / patch_len;
    let out = tower.forward(
        &Tensor::from_vec(pixels, (n, patch_len), device)?,
        &grids,
        adapter,
    )?;
    let mut at = 0;
    for (p, _) in prompts {
        let len = p.rows;
        p.embeds = Some(ImageEmbeds {
            merged: out.merged.narrow(0, at, len)?,
            deepstack: out
                .deepstack
                .iter()
                .map(|d| d.narrow(0, at, len))
                .collect::<candle_core::Result<_>>()?,
        });
        at += len;
    }
    Ok(())
}
