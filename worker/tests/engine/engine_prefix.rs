//! Automatic prefix caching on the committed tiny Llama (tests/fixtures/engine), on the
//! tensor path (the paged cache a GPU runs) and the host path (the CPU's): a request whose
//! prompt starts with blocks another request computed reuses them and answers as if it had
//! computed them; a block computed under one adapter is never reused under another or under
//! the base; a small cache evicts cached blocks and loses no request.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

use crate::common;

use common::{
    engine_reference as reference, fixture_adapter, greedy, host_engine, ids, tensor_engine,
    wait_until,
};
use mole_engine::api::*;
use mole_engine::{Engine, EngineOptions};

/// Tokens per KV block (the engine's).
const BLOCK: usize = 16;

/// The fixture's prompts one after another until `len` tokens.
fn long_prompt(len: usize) -> Vec<u32> {
    let r = &reference()["llama"];
    let parts = [ids(&r["prompts"][0]), ids(&r["prompts"][1])];
    parts.iter().cycle().flatten().copied().take(len).collect()
}

/// The llama fixture's engine on the tensor or the host path, prefix caching on or off,
/// with the fixture adapters `a` and `b` loaded.
fn engine(tensor: bool, caching: bool, f: impl Fn(&mut EngineOptions)) -> Engine {
    let opts = |o: &mut EngineOptions| {
        o.prefix_caching = caching;
        f(o);
    };
    let e = match tensor {
        true => tensor_engine(opts),
        false => host_engine(opts),
    };
    e.load_adapter(fixture_adapter("a", "v1", "a_r8_all"))
        .unwrap();
    let mut b = fixture_adapter("b", "v1", "b_r4_qv");
    b.lora_id = 2;
    e.load_adapter(b).unwrap();
    e
}

/// A greedy answer's tokens and their log-probabilities.
fn answer(e: &Engine, prompt: &[u32], adapter: Option<&str>, max_tokens: usize) -> Vec<(u32, f32)> {
    let mut req = greedy(prompt.to_vec(), adapter, max_tokens);
    req.sampling.logprobs = Some(0);
    collect(e.submit(req).unwrap())
}

fn collect(mut rx: EventStream) -> Vec<(u32, f32)> {
    let mut out = Vec::new();
    loop {
        match rx.blocking_recv().expect("a final event") {
            TokenEvent::Token {
                token_id, logprob, ..
            } => out.push((token_id, logprob.expect("logprobs asked").logprob)),
            TokenEvent::Finished { .. } => return out,
            TokenEvent::Error(e) => panic!("{e}"),
            TokenEvent::Started { .. } => {}
        }
    }
}

/// The same tokens, and log-probabilities within 1e-5 (a reused block's keys and values were
/// computed in another batch shape; the arithmetic is the same up to the order of sums).
fn assert_same(got: &[(u32, f32)], want: &[(u32, f32)], what: &str) {
    let tokens = |v: &[(u32, f32)]| v.iter().map(|x| x.0).collect::<Vec<_>>();
    assert_eq!(tokens(got), tokens(want), "{what}: tokens");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g.1 - w.1).abs() < 1e-5,
            "{what}: token {i}'s logprob {} against {} computed",
            g.1,
            w.1
        );
    }
}

/// Prefix-cache (queries, hits) in tokens of `adapter` ("" the base).
fn counts(e: &Engine, adapter: &str) -> (u64, u64) {
    e.stats()
        .prefix_cache
        .iter()
        .find(|c| c.adapter == adapter)
        .map_or((0, 0), |c| (c.queries, c.hits))
}

/// Tokens reused of a `len`-token prompt all of whose tokens were computed before: on the
/// tensor path its full blocks but the one holding its last token (whole blocks only, as
/// vLLM), on the host path every token but its last (its blocks are also found by tokens).
fn reused(tensor: bool, len: usize) -> u64 {
    match tensor {
        true => ((len - 1) / BLOCK * BLOCK) as u64,
        false => (len - 1) as u64,
    }
}

/// A second prompt sharing the first's leading 38 tokens reuses their two full blocks (32
/// tokens; on the host path also the 6 tokens after them, found by their tokens) and answers,
/// tokens and log-probabilities, as the engine without the cache does: on both paths, with
/// the base and with an adapter. Then the same prompt again reuses every full block but the
/// one holding its last token (the step needs that token's logits; the host path reuses all
/// its tokens but that one).
#[test]
fn a_reused_prefix_answers_as_a_computed_one() {
    let shared = long_prompt(38);
    let first: Vec<u32> = shared.iter().copied().chain([5, 6, 7]).collect();
    let second: Vec<u32> = shared.iter().copied().chain([9, 10]).collect();
    let whole: Vec<u32> = long_prompt(48);
    for tensor in [true, false] {
        let on = engine(tensor, true, |_| {});
        let off = engine(tensor, false, |_| {});
        for adapter in [None, Some("a")] {
            let what = format!("tensor path {tensor}, adapter {adapter:?}");
            let label = adapter.unwrap_or("");
            let before = counts(&on, label);
            answer(&on, &first, adapter, 4);
            let got = answer(&on, &second, adapter, 6);
            assert_same(&got, &answer(&off, &second, adapter, 6), &what);
            let (q, h) = counts(&on, label);
            assert_eq!(
                (q - before.0, h - before.1),
                (
                    (first.len() + second.len()) as u64,
                    match tensor {
                        true => 2 * BLOCK,
                        false => shared.len(),
                    } as u64
                ),
                "{what}: queries and hits in tokens"
            );
            answer(&on, &whole, adapter, 3);
            let (_, h) = counts(&on, label);
            let got = answer(&on, &whole, adapter, 3);
            assert_same(&got, &answer(&off, &whole, adapter, 3), &what);
            let (_, h2) = counts(&on, label);
            assert_eq!(
                h2 - h,
                reused(tensor, whole.len()),
                "{what}: 48 tokens, the last token recomputed"
            );
        }
        assert!(
            off.stats().prefix_cache.is_empty(),
            "nothing counted when off"
        );
        assert!(on.stats().prefix_cached_blocks > 0);
    }
}

/// On the host path a prompt seen before is reused up to its last token, as llama.cpp's
/// prompt cache and SGLang's radix cache reuse it, not only its full blocks: the block that
/// holds its end is found by its tokens among the cached blocks that followed the same full
/// blocks, a finished request's last partial block among them. A conversation that goes on
/// (the prompt, the answer, a new turn) reuses everything the previous request computed. The
/// answers are the uncached engine's.
#[test]
fn the_host_path_reuses_a_prompt_up_to_its_last_token() {
    let on = engine(false, true, |_| {});
    let off = engine(false, false, |_| {});
    for adapter in [None, Some("a")] {
        let what = format!("adapter {adapter:?}");
        let label = adapter.unwrap_or("");
        // Two full blocks and 10 tokens; after 8 tokens the cache holds 49 (the last token
        // sampled is never fed back): three full blocks and one token.
        let prompt = long_prompt(42);
        answer(&on, &prompt, adapter, 8);
        // Answers `p` as the uncached engine does, having reused `want` of its tokens.
        let reuses = |p: &[u32], max_tokens: usize, want: u64, why: &str| {
            let (_, before) = counts(&on, label);
            let got = answer(&on, p, adapter, max_tokens);
            assert_same(&got, &answer(&off, p, adapter, max_tokens), &what);
            assert_eq!(counts(&on, label).1 - before, want, "{what}: {why}");
            got
        };
        let got = reuses(
            &prompt,
            8,
            41,
            "the same prompt again, every token but its last",
        );
        let turn: Vec<u32> = prompt
            .iter()
            .copied()
            .chain(got.iter().map(|t| t.0))
            .chain([5, 6, 7])
            .collect();
        reuses(
            &turn,
            4,
            49,
            "the next turn, all the previous request computed",
        );
    }
}

/// A prompt computed under adapter `a` is asked again under the base, under `b` and under
/// `a`: only `a` reuses its blocks (the others' answers are their own, as the engine without
/// the cache gives them). Fails when the adapter is left out of the blocks' key.
#[test]
fn a_block_is_never_reused_under_another_adapter_or_the_base() {
    let prompt = long_prompt(40);
    for tensor in [true, false] {
        let on = engine(tensor, true, |_| {});
        let off = engine(tensor, false, |_| {});
        answer(&on, &prompt, Some("a"), 2);
        for who in [None, Some("b"), Some("a")] {
            let what = format!("tensor path {tensor}, computed under a, asked under {who:?}");
            let got = answer(&on, &prompt, who, 4);
            assert_same(&got, &answer(&off, &prompt, who, 4), &what);
        }
        assert_eq!(counts(&on, "").1, 0, "the base reused a's blocks");
        assert_eq!(counts(&on, "b").1, 0, "b reused a's blocks");
        assert_eq!(
            counts(&on, "a").1,
            reused(tensor, prompt.len()),
            "a reuses its own"
        );
    }
}

/// An adapter unloaded and loaded again from the same unchanged files finds the blocks it
/// computed before (its blocks are keyed by its files' identity, not by the load), while the
/// same name and version loaded from another directory (other weights) reuses nothing.
#[test]
fn an_adapter_loaded_again_from_the_same_files_finds_its_blocks() {
    let prompt = long_prompt(40);
    for tensor in [true, false] {
        let what = format!("tensor path {tensor}");
        let on = engine(tensor, true, |_| {});
        let off = engine(tensor, false, |_| {});
        answer(&on, &prompt, Some("a"), 2);
        // (files "a" is loaded from, the adapter of `off` with those weights, tokens reused)
        let again = [
            (
                "a_r8_all",
                "a",
                reused(tensor, prompt.len()),
                "the same files",
            ),
            ("b_r4_qv", "b", 0, "other files"),
        ];
        for (dir, same, want, from) in again {
            on.unload_adapter("a").unwrap();
            on.load_adapter(fixture_adapter("a", "v1", dir)).unwrap();
            let (_, before) = counts(&on, "a");
            let got = answer(&on, &prompt, Some("a"), 4);
            assert_same(&got, &answer(&off, &prompt, Some(same), 4), &what);
            assert_eq!(
                counts(&on, "a").1 - before,
                want,
                "{what}: loaded again from {from}"
            );
        }
    }
}

/// Eight KV blocks (128 tokens) and requests of three or four blocks each, many at once and
/// then again: cached blocks are evicted as new requests need room, the running ones are
/// preempted when the step outgrows the pool, and every answer is still the uncached one.
/// The host path's store is bounded by the same count.
#[test]
fn a_small_cache_evicts_and_loses_no_request() {
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|i| {
            let mut p = long_prompt(36 + i);
            p[0] = 3 + i as u32;
            p
        })
        .collect();
    for tensor in [true, false] {
        let small = |o: &mut EngineOptions| {
            o.kv_blocks = Some(8);
            o.max_seq_len = 128;
            o.max_batch_size = 4;
        };
        let on = engine(tensor, true, small);
        let off = engine(tensor, false, small);
        let want: Vec<_> = prompts.iter().map(|p| answer(&off, p, None, 12)).collect();
        for round in 0..2 {
            let streams: Vec<_> = prompts
                .iter()
                .map(|p| {
                    let mut req = greedy(p.clone(), None, 12);
                    req.sampling.logprobs = Some(0);
                    on.submit(req).unwrap()
                })
                .collect();
            for (i, rx) in streams.into_iter().enumerate() {
                let what = format!("tensor path {tensor}, round {round}, request {i}");
                assert_same(&collect(rx), &want[i], &what);
            }
        }
        // The engine retires a sequence just after its last token is sent.
        wait_until("the batch is empty", || on.stats().running == 0);
        let s = on.stats();
        assert!(s.prefix_cached_blocks <= 8, "{s:?}");
        if let Some((free, total)) = s.kv_blocks {
            assert_eq!((free, total), (8, 8), "every block back: {s:?}");
        }
        // The last prompt alone after the others: its blocks were among the last cached.
        let (_, before) = counts(&on, "");
        let got = answer(&on, &prompts[5], None, 12);
        assert_same(&got, &want[5], &format!("tensor path {tensor}, last again"));
        let hits = counts(&on, "").1 - before;
        assert_eq!(hits, reused(tensor, prompts[5].len()), "{s:?}");
    }
}

/// A request preempted when the paged cache fills is queried once: readmitted, it looks its
/// blocks up again, but its prompt is not added to `prefix_cache_queries` (nor its blocks to the
/// hits) a second time, as vLLM counts a resumed request's lookups apart from new requests'.
#[test]
fn a_preempted_request_counts_its_prefix_query_once() {
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|i| {
            let mut p = long_prompt(36 + i);
            p[0] = 3 + i as u32;
            p
        })
        .collect();
    // As op_count_transfers preempts: short prompts growing past a 6-block cache.
    let prompts: Vec<Vec<u32>> = prompts.iter().map(|p| p[..6].to_vec()).collect();
    let on = engine(true, true, |o| {
        o.kv_blocks = Some(6);
        o.prefill_chunk = 5;
        o.max_batch_size = 4;
    });
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| on.submit(greedy(p.clone(), None, 32)).unwrap())
        .collect();
    for rx in streams {
        common::tokens(rx);
    }
    wait_until("the batch is empty", || on.stats().running == 0);
    let s = on.stats();
    assert!(s.preemptions > 0, "the test needs a preemption: {s:?}");
    let prompted: usize = prompts.iter().map(Vec::len).sum();
    assert_eq!(
        counts(&on, "").0,
        prompted as u64,
        "queries: each prompt once, {} preemptions",
        s.preemptions
    );
}

/// `n` choices share their prompt's blocks, and a later request with that prompt finds them
/// cached.
#[test]
fn choices_and_later_requests_share_a_prompts_blocks() {
    let prompt = long_prompt(35);
    for tensor in [true, false] {
        let on = engine(tensor, true, |_| {});
        let off = engine(tensor, false, |_| {});
        let want = answer(&off, &prompt, Some("b"), 5);
        let mut req = greedy(prompt.clone(), Some("b"), 5);
        req.sampling.logprobs = Some(0);
        for rx in on.submit_n(req, 3).unwrap() {
            assert_same(
                &collect(rx),
                &want,
                &format!("tensor path {tensor}, a choice"),
            );
        }
        let got = answer(&on, &prompt, Some("b"), 5);
        assert_same(&got, &want, &format!("tensor path {tensor}, later"));
        assert_eq!(counts(&on, "b").1, reused(tensor, prompt.len()));
    }
}

/// vLLM's `cache_salt`: a request with a salt never reuses blocks of a request without it, or
/// with another salt; requests with the same salt do.
#[test]
fn a_cache_salt_isolates_its_requests() {
    let prompt = long_prompt(40);
    let salted = |salt: Option<&str>| {
        let mut req = greedy(prompt.clone(), None, 2);
        req.sampling.cache_salt = salt.map(String::from);
        req.sampling.logprobs = Some(0);
        req
    };
    for tensor in [true, false] {
        let on = engine(tensor, true, |_| {});
        let again = reused(tensor, prompt.len());
        for (salt, hits) in [
            (None, 0),
            (Some("x"), 0),
            (Some("y"), 0),
            (Some("x"), again),
        ] {
            let (_, before) = counts(&on, "");
            collect(on.submit(salted(salt)).unwrap());
            assert_eq!(
                counts(&on, "").1 - before,
                hits,
                "tensor path {tensor}, salt {salt:?}"
            );
        }
    }
}

/// The tiny Qwen3-VL fixture's image `file`, with its digest.
fn vision_image(file: &str, digest: u8) -> Image {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vision");
    let bytes = std::fs::read(dir.join("images").join(file)).unwrap();
    let rgb = image::load_from_memory(&bytes).unwrap().to_rgb8();
    Image {
        width: rgb.width(),
        height: rgb.height(),
        rgb: std::sync::Arc::from(rgb.into_raw()),
        digest: [digest; 32],
    }
}

/// The tiny Qwen3-VL on the tensor or host path, prefix caching on or off.
fn vision_engine(tensor: bool, caching: bool) -> Engine {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vision/qwen3_vl");
    let opts = EngineOptions {
        base_name: "qwen3-vl-tiny".into(),
        max_seq_len: 512,
        prefix_caching: caching,
        backend: mole_model::BackendKind::host_if(!tensor),
        ..Default::default()
    };
    let model = mole_model::Decoder::load(&dir, candle_core::DType::F32, &candle_core::Device::Cpu)
        .unwrap();
    let text = mole_engine::text::TextModel::load(&dir).unwrap();
    Engine::start(model, text, opts)
}

/// Images: a second question about the same image reuses the blocks of the image and the
/// text before the question, and answers as computed; a question about another image with the
/// same text reuses nothing (the image starts in the first block, and an image's content is
/// in its blocks' keys).
#[test]
fn image_blocks_are_reused_only_for_the_same_image() {
    for tensor in [true, false] {
        let on = vision_engine(tensor, true);
        let off = vision_engine(tensor, false);
        let ask = |e: &Engine, img: &Image, q: &str| {
            let msg = ChatMessage {
                role: "user".into(),
                content: q.into(),
                parts: vec![ContentPart::Image, ContentPart::Text(q.into())],
                extra: Default::default(),
            };
            let text = e.apply_chat_template(&[msg], &Default::default()).unwrap();
            let req = GenerateRequest {
                id: "vision".into(),
                prompt: Prompt::Templated(text),
                adapter: None,
                sampling: SamplingParams {
                    max_tokens: 4,
                    ignore_eos: true,
                    logprobs: Some(0),
                    ..Default::default()
                },
                images: vec![img.clone()],
            };
            collect(e.submit(req).unwrap())
        };
        let (square, wide) = (vision_image("square.png", 1), vision_image("wide.png", 2));
        let q1 = "Describe what is on this screen, every window and every button on it, in detail.";
        let q2 = "Describe what is on this screen, every window and every button on it, briefly!";
        ask(&on, &square, q1);
        let (_, before) = counts(&on, "");
        let got = ask(&on, &square, q2);
        assert_same(
            &got,
            &ask(&off, &square, q2),
            &format!("tensor {tensor}, same image"),
        );
        let hit = counts(&on, "").1 - before;
        assert!(
            hit >= 2 * BLOCK as u64,
            "tensor {tensor}: the image's blocks reused: {hit}"
        );
        let (_, before) = counts(&on, "");
        let got = ask(&on, &wide, q1);
        assert_same(
            &got,
            &ask(&off, &wide, q1),
            &format!("tensor {tensor}, another image"),
        );
        let hit = counts(&on, "").1 - before;
        // The image starts within the first block: nothing before it is a whole block.
        assert_eq!(hit, 0, "tensor {tensor}: another image's blocks");
    }
}

/// The vision tower runs only for an image some placeholder of which is computed: a second
/// question about an image whose blocks were all reused encodes nothing, one whose reuse ends
/// inside the image encodes it (whole: the tower attends over all its patches; the step takes
/// the rows of its uncomputed placeholders), and both answer as computed without the cache.
/// On both paths; `vision_encodes` counts the images the tower encoded.
#[test]
fn an_image_whose_blocks_were_all_reused_is_not_encoded() {
    let q1 = "Describe what is on this screen, every window and every button on it, in detail.";
    let q2 = "Describe what is on this screen, every window and every button on it, briefly!";
    let q3 = "List the windows on this screen.";
    for tensor in [true, false] {
        let on = vision_engine(tensor, true);
        let off = vision_engine(tensor, false);
        // Its placeholders span more than one block.
        let image = vision_image("large.png", 3);
        // Text before the image shifts it so that a reuse ending where the questions part
        // falls inside it: the first of these leads that does.
        let prompt_with = |e: &Engine, lead: &str, q: &str| {
            let msg = ChatMessage {
                role: "user".into(),
                content: q.into(),
                parts: vec![
                    ContentPart::Text(lead.into()),
                    ContentPart::Image,
                    ContentPart::Text(q.into()),
                ],
                extra: Default::default(),
            };
            Prompt::Templated(e.apply_chat_template(&[msg], &Default::default()).unwrap())
        };
        let leads = [
            "Look.",
            "Look at this.",
            "Please look at this.",
            "Here, look at it now.",
        ];
        let geometry = |lead: &str| {
            let ids = |q: &str| {
                on.tokenize(&prompt_with(&on, lead, q), std::slice::from_ref(&image))
                    .unwrap()
            };
            let first = ids(q1);
            let at = |q: &str| {
                let other = ids(q);
                let shared = first.iter().zip(&other).take_while(|(a, b)| a == b).count();
                shared.min(other.len() - 1) / BLOCK * BLOCK
            };
            let image_token = 250; // the fixture's config.json `image_token_id`
            let placeholders = (
                first.iter().position(|&t| t == image_token).unwrap(),
                first.iter().rposition(|&t| t == image_token).unwrap(),
            );
            (placeholders, at(q2), at(q3))
        };
        let lead = *leads
            .iter()
            .find(|l| {
                let ((a, b), covered, split) = geometry(l);
                covered > b && (a + 1..=b).contains(&split)
            })
            .expect("a lead that splits the image");
        let prompt = |e: &Engine, q: &str| prompt_with(e, lead, q);
        let ask = |e: &Engine, q: &str| {
            let req = GenerateRequest {
                id: "vision".into(),
                prompt: prompt(e, q),
                adapter: None,
                sampling: SamplingParams {
                    max_tokens: 4,
                    ignore_eos: true,
                    logprobs: Some(0),
                    ..Default::default()
                },
                images: vec![image.clone()],
            };
            collect(e.submit(req).unwrap())
        };
        let ((first, last), _, _) = geometry(lead);
        let tokens = on.image_tokens(image.width, image.height).unwrap();
        assert_eq!(last + 1 - first, tokens, "one run of placeholders");

        let encodes = || on.stats().vision_encodes;
        ask(&on, q1);
        assert_eq!(encodes(), 1, "tensor {tensor}: the first question");
        let got = ask(&on, q2);
        assert_same(&got, &ask(&off, q2), &format!("tensor {tensor}, covered"));
        assert_eq!(encodes(), 1, "tensor {tensor}: an image all reused");
        let got = ask(&on, q3);
        assert_same(&got, &ask(&off, q3), &format!("tensor {tensor}, split"));
        assert_eq!(encodes(), 2, "tensor {tensor}: an image partly reused");
        assert_eq!(
            off.stats().vision_encodes,
            2,
            "tensor {tensor}: without the cache"
        );
    }
}

/// The classifier router's scoring pass is a request like any other: a second scoring of a
/// prompt under the classifier adapter reuses the first one's blocks, and scores as it did.
#[test]
fn the_classifier_prompt_reuses_its_blocks() {
    let text = "Classify this request about invoices, refunds and shipping delays for the shop.";
    let labels = ["a".to_string(), "b".to_string()];
    for tensor in [true, false] {
        let on = engine(tensor, true, |_| {});
        let first = on.score_labels(Some("a"), text, &labels, &[]).unwrap();
        let (_, before) = counts(&on, "a");
        let again = on.score_labels(Some("a"), text, &labels, &[]).unwrap();
        assert!(
            counts(&on, "a").1 - before >= BLOCK as u64,
            "tensor path {tensor}"
        );
        for (x, y) in first.iter().zip(&again) {
            assert!(
                (x - y).abs() < 1e-5,
                "tensor path {tensor}: {first:?} then {again:?}"
            );
        }
    }
}
