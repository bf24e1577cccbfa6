//! Images of a request inside the engine: preprocessed at submit (the caller's thread), their
//! placeholders expanded to one token per merged patch block, M-RoPE positions laid out; the
//! vision tower runs once per engine step over the images of every sequence whose prefill
//! starts in it (once per adapter among them that targets the tower), and each prompt chunk
//! then takes its slice of positions and placeholders.
//!
//! Only images with a placeholder the prefill computes are encoded: an image whose
//! placeholders all lie in blocks the prefix cache gave the sequence is never needed again
//! (its keys and values are cached; the M-RoPE positions after it come from its grid, not its
//! embeddings), so the tower skips it. An image the reused prefix covers in part is encoded
//! whole (the tower attends across all of an image's patches, so its uncomputed rows cannot be
//! had without the others) and the step takes the rows of its uncomputed placeholders.

use std::path::Path;

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::api::{EngineError, Image};
use mole_model::vision::preprocess::{self, Patches, ProcessorConfig};
use mole_model::vision::{mrope_positions, ImageEmbeds, VisionTower};
use mole_model::{LoraAdapter, ModelError, VisionSpec};

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

    /// The image placeholder token.
    pub(super) fn image_token(&self) -> u32 {
        self.image_token
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
                encoded: vec![None; distinct.len()],
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
    /// The tower's output for the images it encoded, once it ran (kept while the sequence
    /// lives: a preempted sequence recomputes its prompt from it).
    pub(super) embeds: Option<ImageEmbeds>,
    /// Per distinct image, its first row in `embeds` (None: not encoded, as an image whose
    /// placeholders the prefix cache held all of is not).
    encoded: Vec<Option<u32>>,
}

impl ImagePrompt {
    /// The distinct image whose embedding rows hold `row`.
    fn image_of(&self, row: u32) -> usize {
        self.first_rows.partition_point(|&r| r <= row) - 1
    }

    /// Per distinct image, whether a placeholder of it is at or after context token `from`:
    /// the images a prefill from `from` needs embedded.
    fn needed_from(&self, from: usize) -> Vec<bool> {
        let mut needed = vec![false; self.digests.len()];
        let start = self
            .image_tokens
            .partition_point(|(i, _)| (*i as usize) < from);
        for &(_, row) in &self.image_tokens[start..] {
            needed[self.image_of(row)] = true;
        }
        needed
    }

    /// Whether a prefill from context token `from` needs an image the tower has not encoded
    /// for this sequence (at its first chunk; or after a preemption that lost cached blocks
    /// of an image skipped before).
    pub(super) fn needs_encoding(&self, from: usize) -> bool {
        self.needed_from(from)
            .iter()
            .zip(&self.encoded)
            .any(|(&n, e)| n && e.is_none())
    }

    /// Positions and placeholders (indices relative to `from`, rows of `embeds`) of context
    /// tokens `from..to`; tokens past the prompt (recomputed after a preemption) are text.
    /// Every image with a placeholder among them is encoded ([`ImagePrompt::needs_encoding`]
    /// was false).
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
            .map(|&(i, row)| {
                let u = self.image_of(row);
                let at = self.encoded[u].expect("the chunk's images encoded before the step");
                (i - from as u32, at + row - self.first_rows[u])
            })
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
                let u = self.image_of(row);
                (i, self.digests[u], row - self.first_rows[u])
            })
    }

    /// Where decoding continues: position minus index after the prompt.
    pub(super) fn offset(&self) -> i64 {
        self.offset
    }
}

/// A prompt chunk's share of its images: see [`mole_model::RowVision`].
pub(super) struct Chunk {
    /// M-RoPE position of each of the chunk's tokens.
    pub(super) positions: Vec<[u32; 3]>,
    /// The chunk's placeholders: (index in the chunk, row of the embeddings).
    pub(super) image_tokens: Vec<(u32, u32)>,
}

/// A sequence's images to encode before a step: its prompt's images, the adapter it runs
/// with, and the context token its prefill goes on from (the images wholly before it are not
/// encoded).
pub(super) type Pending<'a> = (&'a mut ImagePrompt, Option<&'a LoraAdapter>, usize);

/// Runs the vision tower over the images `prompts` need and have not encoded, once per
/// adapter among them (once in all when no adapter targets the tower), and hands each prompt
/// its share. Returns the images encoded.
pub(super) fn encode(
    tower: &VisionTower,
    device: &Device,
    prompts: &mut [Pending<'_>],
) -> Result<usize, ModelError> {
    let mut todo: Vec<&mut Pending<'_>> = prompts
        .iter_mut()
        .filter(|(p, _, from)| p.needs_encoding(*from))
        .collect();
    // An adapter that leaves the tower alone encodes as the base does.
    let key = |a: Option<&LoraAdapter>| a.filter(|a| a.has_vision()).map(|a| a as *const _);
    let mut images = 0;
    while let Some(first) = todo.first().map(|(_, a, _)| *a) {
        let group = key(first);
        let (mine, rest): (Vec<_>, Vec<_>) =
            todo.into_iter().partition(|(_, a, _)| key(*a) == group);
        todo = rest;
        images += encode_group(tower, device, mine, first.filter(|a| a.has_vision()))?;
    }
    Ok(images)
}

/// One tower pass over the images `prompts` need, with `adapter`; returns how many.
fn encode_group(
    tower: &VisionTower,
    device: &Device,
    prompts: Vec<&mut Pending<'_>>,
    adapter: Option<&LoraAdapter>,
) -> Result<usize, ModelError> {
    let Some(patch_len) = prompts.first().map(|(p, _, _)| p.patch_len) else {
        return Ok(0);
    };
    let mut pixels = Vec::new();
    let mut grids = Vec::new();
    // Per prompt: which of its images go in, and the embedding rows they take.
    let mut plans = Vec::with_capacity(prompts.len());
    for (p, _, from) in &prompts {
        let needed = p.needed_from(*from);
        let mut at = 0usize;
        let mut rows = 0u32;
        let mut encoded = vec![None; needed.len()];
        for (u, grid) in p.grids.iter().enumerate() {
            let patches = grid.iter().product::<usize>();
            if needed[u] {
                pixels.extend_from_slice(&p.pixels[at * patch_len..(at + patches) * patch_len]);
                grids.push(*grid);
                encoded[u] = Some(rows);
                let end = p.first_rows.get(u + 1).map_or(p.rows as u32, |&r| r);
                rows += end - p.first_rows[u];
            }
            at += patches;
        }
        plans.push((encoded, rows as usize));
    }
    let n = pixels.len() / patch_len;
    let out = tower.forward(
        &Tensor::from_vec(pixels, (n, patch_len), device)?,
        &grids,
        adapter,
    )?;
    let mut at = 0;
    for ((p, _, _), (encoded, len)) in prompts.into_iter().zip(plans) {
        p.embeds = Some(ImageEmbeds {
            merged: out.merged.narrow(0, at, len)?,
            deepstack: out
                .deepstack
                .iter()
                .map(|d| d.narrow(0, at, len))
                .collect::<candle_core::Result<_>>()?,
        });
        p.encoded = encoded;
        at += len;
    }
    Ok(grids.len())
}
