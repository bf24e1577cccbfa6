//! mole's merge against PEFT's `merge_and_unload(safe_merge=True)` on committed fixtures
//! (tests/fixtures/merge, written by generate.py), plus every bad input of issue 4.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use mole_engine::ModelSource;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mole_tools::merge::{bf16_ulp_distance, merge, to_f32, MergeError, MergeOptions, OutDtype};
use safetensors::{Dtype, SafeTensors};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/merge")
}

const ADAPTERS: &[&str] = &[
    "plain_r8",
    "rslora",
    "patterns",
    "save_lm_head",
    "embedding",
    "regex",
];

fn opts(base: &str, adapter: &str, out: &Path) -> MergeOptions {
    MergeOptions {
        base: fixtures().join(base),
        adapter: fixtures().join("adapters").join(adapter),
        out: out.to_path_buf(),
        safe_merge: true,
        dtype: None,
        root: None,
        expect_base: Some("mole-fixtures/tiny-qwen3".into()),
        max_rank: 64,
        adapter_name: Some(adapter.into()),
        adapter_version: Some("v1".into()),
    }
}

/// All tensors of a model directory (every shard): name → (dtype, shape, raw bytes).
fn read_dir_tensors(dir: &Path) -> BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            out.extend(read_file_tensors(&p));
        }
    }
    out
}

fn read_file_tensors(p: &Path) -> BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(p).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.iter()
        .map(|(n, v)| {
            (
                n.to_string(),
                (v.dtype(), v.shape().to_vec(), v.data().to_vec()),
            )
        })
        .collect()
}

/// Largest difference relative to the reference tensor's largest magnitude: the matmul's
/// summation order differs between torch and mole, which moves single elements by a few f32
/// ulps of the tensor scale, never more.
fn scaled_error(ours: &[f32], want: &[f32]) -> f32 {
    let scale = want
        .iter()
        .fold(0f32, |m, x| m.max(x.abs()))
        .max(f32::MIN_POSITIVE);
    ours.iter()
        .zip(want)
        .map(|(x, y)| (x - y).abs() / scale)
        .fold(0f32, f32::max)
}

#[test]
fn f32_merges_match_peft_within_1e6_relative() {
    for adapter in ADAPTERS {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let report = merge(&opts("base_f32", adapter, &out)).unwrap();
        assert!(report.written);
        let ours = read_dir_tensors(&out);
        let peft =
            read_file_tensors(&fixtures().join(format!("peft/base_f32/{adapter}.safetensors")));
        assert_eq!(
            ours.keys().collect::<Vec<_>>(),
            peft.keys().collect::<Vec<_>>(),
            "{adapter}: same tensor names"
        );
        let mut changed = 0;
        let base = read_dir_tensors(&fixtures().join("base_f32"));
        for (name, (dt, shape, bytes)) in &ours {
            let (pdt, pshape, pbytes) = &peft[name];
            assert_eq!((dt, shape), (pdt, pshape), "{adapter} {name}");
            let a = to_f32(*dt, bytes).unwrap();
            let b = to_f32(*pdt, pbytes).unwrap();
            let worst = scaled_error(&a, &b);
            assert!(worst <= 1e-6, "{adapter} {name}: relative error {worst}");
            if base[name].2 != *bytes {
                changed += 1;
            }
        }
        assert!(changed > 0, "{adapter}: the merge changed nothing");
        assert_eq!(report.metadata.total_params, 35008);
    }
}

#[test]
fn bf16_sharded_merges_round_once_and_are_never_farther_from_exact_than_peft() {
    for adapter in ADAPTERS {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        merge(&opts("base_bf16", adapter, &out)).unwrap();
        // Same sharding and index as the base.
        let idx: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
        )
        .unwrap();
        let base_idx: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixtures().join("base_bf16/model.safetensors.index.json"))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(idx["weight_map"], base_idx["weight_map"]);
        assert!(out.join("model-00001-of-00002.safetensors").exists());
        assert!(out.join("config.json").exists() && out.join("generation_config.json").exists());

        let ours = read_dir_tensors(&out);
        let peft =
            read_file_tensors(&fixtures().join(format!("peft/base_bf16/{adapter}.safetensors")));
        // The exact merged value, from the f32 fixtures: bf16 base + (f32 merge - f32 base).
        let base_bf16 = read_dir_tensors(&fixtures().join("base_bf16"));
        let base_f32 = read_dir_tensors(&fixtures().join("base_f32"));
        let f32_tmp = tempfile::tempdir().unwrap();
        merge(&opts("base_f32", adapter, &f32_tmp.path().join("o"))).unwrap();
        let merged_f32 = read_dir_tensors(&f32_tmp.path().join("o"));
        // Tensors the adapter replaces (modules_to_save, saved embeddings) start from the
        // adapter's f32 values, not from the bf16 base.
        let replaced: Vec<String> = read_file_tensors(
            &fixtures().join(format!("adapters/{adapter}/adapter_model.safetensors")),
        )
        .into_keys()
        .filter(|k| !k.contains("lora_"))
        .map(|k| {
            k.trim_start_matches("base_model.model.")
                .replace(".base_layer", "")
        })
        .collect();
        let (mut total, mut one, mut more) = (0usize, 0usize, 0usize);
        for (name, (dt, _, bytes)) in &ours {
            let is_replaced = replaced.contains(name);
            let (pdt, _, pbytes) = &peft[name];
            assert_eq!((*dt, *pdt), (Dtype::BF16, Dtype::BF16));
            let b16 = to_f32(Dtype::BF16, &base_bf16[name].2).unwrap();
            let b32 = to_f32(Dtype::F32, &base_f32[name].2).unwrap();
            let m32 = to_f32(Dtype::F32, &merged_f32[name].2).unwrap();
            let ours_v = to_f32(Dtype::BF16, bytes).unwrap();
            let peft_v = to_f32(Dtype::BF16, pbytes).unwrap();
            for (i, (x, y)) in bytes
                .chunks_exact(2)
                .zip(pbytes.chunks_exact(2))
                .enumerate()
            {
                let (x, y) = (
                    u16::from_le_bytes([x[0], x[1]]),
                    u16::from_le_bytes([y[0], y[1]]),
                );
                let exact = if is_replaced {
                    m32[i] as f64
                } else {
                    b16[i] as f64 + (m32[i] as f64 - b32[i] as f64)
                };
                let nearest = half::bf16::from_f64(exact).to_bits();
                // mole rounds once: it is the nearest bf16 to the exact value (one ulp of
                // slack for the f32 estimate of the delta landing on a rounding tie).
                assert!(bf16_ulp_distance(x, nearest) <= 1, "{adapter} {name}[{i}]");
                let d = bf16_ulp_distance(x, y);
                total += 1;
                if d == 0 {
                    continue;
                }
                // PEFT rounds the delta to bf16 before adding it to the bf16 weight (two
                // roundings); mole adds in f32 and rounds once. Wherever they differ, mole must
                // be at least as close to the exact value.
                assert!(
                    (ours_v[i] as f64 - exact).abs() <= (peft_v[i] as f64 - exact).abs(),
                    "{adapter} {name}[{i}]: {d} ulps from PEFT and not closer to exact"
                );
                if d == 1 {
                    one += 1;
                } else {
                    more += 1;
                }
            }
        }
        eprintln!(
            "{adapter}: {total} bf16 elements: {one} one ulp from PEFT, {more} more than one \
             (PEFT rounds twice; mole is as close or closer to exact in every case)"
        );
    }
}

#[test]
fn rerun_with_identical_inputs_is_a_noop_and_other_inputs_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let first = merge(&opts("base_f32", "plain_r8", &out)).unwrap();
    let mtime = std::fs::metadata(out.join("model.safetensors"))
        .unwrap()
        .modified()
        .unwrap();
    let again = merge(&opts("base_f32", "plain_r8", &out)).unwrap();
    assert!(!again.written);
    assert_eq!(again.metadata, first.metadata);
    assert_eq!(
        std::fs::metadata(out.join("model.safetensors"))
            .unwrap()
            .modified()
            .unwrap(),
        mtime
    );
    let err = merge(&opts("base_f32", "rslora", &out)).unwrap_err();
    assert_eq!(err.code(), "output_exists");
}

#[test]
fn metadata_records_provenance() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    merge(&opts("base_f32", "patterns", &out)).unwrap();
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("merge_metadata.json")).unwrap())
            .unwrap();
    assert_eq!(m["adapter_name"], "patterns");
    assert_eq!(m["adapter_version"], "v1");
    assert_eq!(m["base_model"], "mole-fixtures/tiny-qwen3");
    assert_eq!(m["safe_merge"], true);
    assert_eq!(m["adapter_sha256"].as_str().unwrap().len(), 64);
    assert_eq!(m["base_index_sha256"].as_str().unwrap().len(), 64);
    // alpha 16 / r 8 = 2; v_proj r=4 → 4; o_proj alpha 4 / r 8 = 0.5; down_proj layer 1 r=2 → 8.
    assert_eq!(m["scales"]["q_proj"], serde_json::json!([2.0]));
    assert_eq!(m["scales"]["v_proj"], serde_json::json!([4.0]));
    assert_eq!(m["scales"]["o_proj"], serde_json::json!([0.5]));
    assert_eq!(m["scales"]["down_proj"], serde_json::json!([2.0, 8.0]));
}

#[test]
fn dtype_flag_converts_the_output() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let mut o = opts("base_f32", "plain_r8", &out);
    o.dtype = Some(OutDtype::Bf16);
    merge(&o).unwrap();
    let ours = read_dir_tensors(&out);
    assert!(ours.values().all(|(dt, _, _)| *dt == Dtype::BF16));
    let cfg = std::fs::read_to_string(out.join("config.json")).unwrap();
    assert!(cfg.contains("bfloat16"));
}

fn expect_err(o: MergeOptions, code: &str, needle: &str) -> MergeError {
    let out = o.out.clone();
    let err = merge(&o).unwrap_err();
    assert_eq!(err.code(), code, "{err}");
    assert!(
        err.to_string().contains(needle),
        "{err} should mention {needle}"
    );
    assert!(!out.exists(), "a failed merge leaves no output");
    let parent = out.parent().unwrap();
    let leftovers: Vec<_> = std::fs::read_dir(parent)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "no temporary directory left behind");
    err
}

#[test]
fn nan_adapter_fails_safe_merge_naming_the_module() {
    let tmp = tempfile::tempdir().unwrap();
    // Sharded base: the NaN is found after the first shard was written; nothing is left.
    let e = expect_err(
        opts("base_bf16", "bad_nan", &tmp.path().join("out")),
        "non_finite_weights",
        "model.layers.0.self_attn.q_proj",
    );
    assert_eq!(e.exit_code(), 2);
}

#[test]
fn shape_mismatch_wrong_base_and_rank_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    expect_err(
        opts("base_f32", "bad_shape", &tmp.path().join("a")),
        "shape_mismatch",
        "model.layers.0.self_attn.q_proj",
    );
    expect_err(
        opts("base_f32", "bad_base", &tmp.path().join("b")),
        "wrong_base_model",
        "someone/another-model",
    );
    let mut o = opts("base_f32", "rslora", &tmp.path().join("c"));
    o.max_rank = 8;
    expect_err(o, "rank_over_limit", "rank 16");
}

#[test]
fn pickle_files_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let adapter = tmp.path().join("pickled");
    std::fs::create_dir_all(&adapter).unwrap();
    std::fs::copy(
        fixtures().join("adapters/plain_r8/adapter_config.json"),
        adapter.join("adapter_config.json"),
    )
    .unwrap();
    std::fs::write(adapter.join("adapter_model.bin"), b"\x80\x04pickle").unwrap();
    let mut o = opts("base_f32", "plain_r8", &tmp.path().join("out"));
    o.adapter = adapter;
    expect_err(o, "pickle_refused", "adapter_model.bin");
}

#[test]
fn paths_escaping_the_root_are_refused_symlinks_included() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("models");
    std::fs::create_dir_all(root.join("merged")).unwrap();
    // The base is reachable only through a symlink that leaves the root.
    std::os::unix::fs::symlink(fixtures().join("base_f32"), root.join("base")).unwrap();
    let mut o = opts("base_f32", "plain_r8", &root.join("merged/out"));
    o.base = root.join("base");
    o.root = Some(root.clone());
    expect_err(o, "path_outside_root", "outside the model root");

    // Inside the root everything works.
    let base_copy = root.join("base-real");
    std::fs::create_dir_all(&base_copy).unwrap();
    for f in ["config.json", "model.safetensors", "generation_config.json"] {
        std::fs::copy(fixtures().join("base_f32").join(f), base_copy.join(f)).unwrap();
    }
    let adapter_copy = root.join("adapter");
    std::fs::create_dir_all(&adapter_copy).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(
            fixtures().join("adapters/plain_r8").join(f),
            adapter_copy.join(f),
        )
        .unwrap();
    }
    let mut o = opts("base_f32", "plain_r8", &root.join("merged/ok"));
    o.base = base_copy;
    o.adapter = adapter_copy.clone();
    o.root = Some(root.clone());
    merge(&o).unwrap();
    // An output path escaping the root is refused too.
    let mut o2 = o.clone();
    o2.out = root.join("../escaped");
    expect_err(o2, "path_outside_root", "outside the model root");
}

#[test]
fn cli_reports_one_line_and_exit_codes() {
    let bin = env!("CARGO_BIN_EXE_mole-worker");
    let tmp = tempfile::tempdir().unwrap();
    let run = |adapter: &str, out: &str| {
        std::process::Command::new(bin)
            .args(["merge", "--safe-merge", "--base"])
            .arg(fixtures().join("base_f32"))
            .arg("--adapter")
            .arg(fixtures().join("adapters").join(adapter))
            .arg("--out")
            .arg(tmp.path().join(out))
            .output()
            .unwrap()
    };
    let ok = run("plain_r8", "ok");
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let bad = run("bad_nan", "bad");
    assert_eq!(bad.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    let last = stderr.lines().last().unwrap();
    assert!(
        last.starts_with("merge failed (non_finite_weights)"),
        "{stderr}"
    );
    let missing = std::process::Command::new(bin)
        .args([
            "merge",
            "--base",
            "/nonexistent",
            "--adapter",
            "/nonexistent",
            "--out",
        ])
        .arg(tmp.path().join("x"))
        .output()
        .unwrap();
    assert_eq!(
        missing.status.code(),
        Some(1),
        "missing files are I/O failures"
    );
}

#[test]
fn an_interrupted_run_leaves_no_output_and_the_next_run_cleans_up() {
    // A killed merge leaves only its temporary sibling (the output appears by rename, at once,
    // at the very end); the next run removes it and produces the complete output.
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let stale = tmp.path().join(".out.tmp-4242");
    std::fs::create_dir_all(&stale).unwrap();
    std::fs::write(
        stale.join("model-00001-of-00002.safetensors"),
        b"half written",
    )
    .unwrap();
    assert!(!out.exists());
    merge(&opts("base_bf16", "plain_r8", &out)).unwrap();
    assert!(!stale.exists(), "the stale temporary directory is removed");
    assert!(out.join("merge_metadata.json").exists());
    assert_eq!(read_dir_tensors(&out).len(), 25);
}

/// A copy of fixture adapter `name` in `dir`, for tests that alter it.
fn copy_adapter(name: &str, dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(fixtures().join("adapters").join(name).join(f), dir.join(f)).unwrap();
    }
    dir.to_path_buf()
}

#[test]
fn dora_adapters_are_refused_with_a_clear_message() {
    let tmp = tempfile::tempdir().unwrap();
    // use_dora in the config.
    let flagged = copy_adapter("plain_r8", &tmp.path().join("dora_flag"));
    let cfg_path = flagged.join("adapter_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["use_dora"] = true.into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let mut o = opts("base_f32", "plain_r8", &tmp.path().join("a"));
    o.adapter = flagged;
    let e = expect_err(o, "unsupported_adapter", "DoRA");
    assert!(e.to_string().contains("use_dora"), "{e}");
    assert_eq!(e.exit_code(), 2);

    // A DoRA magnitude vector in the weights, whatever the config says.
    let vectored = copy_adapter("plain_r8", &tmp.path().join("dora_vector"));
    let weights = vectored.join("adapter_model.safetensors");
    let mut tensors = read_file_tensors(&weights);
    let magnitude: Vec<u8> = (0..64).flat_map(|_| 1.0f32.to_le_bytes()).collect();
    tensors.insert(
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector".into(),
        (Dtype::F32, vec![64], magnitude),
    );
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (dt, shape, bytes))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*dt, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &weights).unwrap();
    let mut o = opts("base_f32", "plain_r8", &tmp.path().join("b"));
    o.adapter = vectored;
    let e = expect_err(o, "unsupported_adapter", "lora_magnitude_vector");
    assert!(
        e.to_string().contains("model.layers.0.self_attn.q_proj"),
        "{e}"
    );
}

#[test]
fn failure_reason_lands_in_the_termination_log() {
    let bin = env!("CARGO_BIN_EXE_mole-worker");
    let tmp = tempfile::tempdir().unwrap();
    let log = tmp.path().join("termination-log");
    let run = |adapter: &str, out: &str| {
        std::process::Command::new(bin)
            .args(["merge", "--safe-merge", "--base"])
            .arg(fixtures().join("base_bf16"))
            .arg("--adapter")
            .arg(fixtures().join("adapters").join(adapter))
            .arg("--out")
            .arg(tmp.path().join(out))
            .env("MOLE_TERMINATION_LOG", &log)
            .output()
            .unwrap()
    };
    let ok = run("plain_r8", "ok");
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(
        !log.exists(),
        "a successful merge writes no termination log"
    );

    let bad = run("bad_nan", "bad");
    assert_eq!(bad.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    let reason = std::fs::read_to_string(&log).unwrap();
    assert_eq!(reason.lines().count(), 1, "one line: {reason:?}");
    let line = reason.trim_end();
    assert!(
        line.starts_with("merge failed (non_finite_weights): model.layers.0.self_attn.q_proj"),
        "{line}"
    );
    assert_eq!(
        stderr.lines().last().unwrap(),
        line,
        "the same line as stderr"
    );
    assert!(!tmp.path().join("bad").exists());
}

#[test]
fn adapter_and_base_paths_escaping_the_root_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("models");
    let outside = tmp.path().join("outside");
    std::fs::create_dir_all(root.join("merged")).unwrap();
    let base = root.join("base");
    std::fs::create_dir_all(&base).unwrap();
    for f in ["config.json", "model.safetensors", "generation_config.json"] {
        std::fs::copy(fixtures().join("base_f32").join(f), base.join(f)).unwrap();
    }
    let adapter_inside = copy_adapter("plain_r8", &root.join("adapter"));
    let adapter_outside = copy_adapter("plain_r8", &outside.join("adapter"));
    let with = |base: PathBuf, adapter: PathBuf, out: &str| {
        let mut o = opts("base_f32", "plain_r8", &root.join("merged").join(out));
        o.base = base;
        o.adapter = adapter;
        o.root = Some(root.clone());
        o
    };

    // `..` out of the root, for the adapter and for the base.
    expect_err(
        with(base.clone(), root.join("../outside/adapter"), "a"),
        "path_outside_root",
        "outside the model root",
    );
    expect_err(
        with(
            root.join("merged/../../models/../outside/adapter"),
            adapter_inside.clone(),
            "b",
        ),
        "path_outside_root",
        "outside the model root",
    );
    // A symlinked adapter directory that leaves the root.
    std::os::unix::fs::symlink(&adapter_outside, root.join("adapter-link")).unwrap();
    expect_err(
        with(base.clone(), root.join("adapter-link"), "c"),
        "path_outside_root",
        "adapter-link",
    );
    // Files inside directories that are inside the root, linked out of it: the adapter's
    // weights, its config, and a base shard named by the index.
    let sneaky = copy_adapter("plain_r8", &root.join("sneaky"));
    std::fs::remove_file(sneaky.join("adapter_model.safetensors")).unwrap();
    std::os::unix::fs::symlink(
        adapter_outside.join("adapter_model.safetensors"),
        sneaky.join("adapter_model.safetensors"),
    )
    .unwrap();
    expect_err(
        with(base.clone(), sneaky.clone(), "d"),
        "path_outside_root",
        "adapter_model.safetensors",
    );
    let sneaky_cfg = copy_adapter("plain_r8", &root.join("sneaky_cfg"));
    std::fs::remove_file(sneaky_cfg.join("adapter_config.json")).unwrap();
    std::os::unix::fs::symlink(
        adapter_outside.join("adapter_config.json"),
        sneaky_cfg.join("adapter_config.json"),
    )
    .unwrap();
    expect_err(
        with(base.clone(), sneaky_cfg, "e"),
        "path_outside_root",
        "adapter_config.json",
    );
    let sharded = root.join("sharded");
    std::fs::create_dir_all(&sharded).unwrap();
    std::fs::copy(
        fixtures().join("base_bf16/model-00001-of-00002.safetensors"),
        sharded.join("model-00001-of-00002.safetensors"),
    )
    .unwrap();
    std::fs::copy(
        fixtures().join("base_bf16/model-00002-of-00002.safetensors"),
        outside.join("shard2.safetensors"),
    )
    .unwrap();
    let index = std::fs::read_to_string(fixtures().join("base_bf16/model.safetensors.index.json"))
        .unwrap()
        .replace(
            "model-00002-of-00002.safetensors",
            "../../outside/shard2.safetensors",
        );
    std::fs::write(sharded.join("model.safetensors.index.json"), index).unwrap();
    std::fs::copy(
        fixtures().join("base_bf16/config.json"),
        sharded.join("config.json"),
    )
    .unwrap();
    expect_err(
        with(sharded, adapter_inside.clone(), "f"),
        "path_outside_root",
        "shard2.safetensors",
    );

    // The same inputs, inside the root, merge.
    merge(&with(base, adapter_inside, "ok")).unwrap();
}

#[test]
fn gpt2_fan_in_fan_out_and_bias_merges_match_peft() {
    // GPT-2's Conv1D layers store weights [in, out] (fan_in_fan_out) and have biases: the
    // adapters train every bias (bias="all"; PEFT saves them and the merge replaces the base
    // biases) or give lora_B a bias (lora_bias=True: bias += scale·lora_B.bias).
    for adapter in ["gpt2_fifo_bias_all", "gpt2_lora_bias"] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let mut o = opts("base_gpt2_f32", adapter, &out);
        o.expect_base = Some("mole-fixtures/tiny-gpt2".into());
        let report = merge(&o).unwrap();
        let ours = read_dir_tensors(&out);
        let peft = read_file_tensors(
            &fixtures().join(format!("peft/base_gpt2_f32/{adapter}.safetensors")),
        );
        let base = read_dir_tensors(&fixtures().join("base_gpt2_f32"));
        assert_eq!(
            ours.keys().collect::<Vec<_>>(),
            peft.keys().collect::<Vec<_>>()
        );
        let mut changed = Vec::new();
        for (name, (dt, shape, bytes)) in &ours {
            let (pdt, pshape, pbytes) = &peft[name];
            assert_eq!((dt, shape), (pdt, pshape), "{adapter} {name}");
            let a = to_f32(*dt, bytes).unwrap();
            let b = to_f32(*pdt, pbytes).unwrap();
            let worst = scaled_error(&a, &b);
            assert!(worst <= 1e-6, "{adapter} {name}: relative error {worst}");
            if base[name].2 != *bytes {
                changed.push(name.as_str());
            }
        }
        let has = |n: &str| changed.contains(&n);
        assert!(has("transformer.h.0.attn.c_attn.weight"), "{changed:?}");
        assert!(has("transformer.h.0.attn.c_attn.bias"), "{changed:?}");
        assert!(has("transformer.h.0.mlp.c_fc.bias"), "{changed:?}");
        if adapter == "gpt2_fifo_bias_all" {
            // bias="all" trains the layer norms' biases too.
            assert!(has("transformer.h.0.ln_1.bias"), "{changed:?}");
            assert!(has("transformer.h.0.mlp.c_proj.weight"), "{changed:?}");
            assert_eq!(report.metadata.modules_merged, 4);
        } else {
            assert!(!has("transformer.h.0.ln_1.bias"), "{changed:?}");
            assert_eq!(report.metadata.modules_merged, 2);
        }
    }
}

/// Writes one safetensors file of bf16/f32 tensors filled from a table of small random values.
fn write_synthetic(path: &Path, tensors: &[(String, Dtype, Vec<usize>)], seed: u64) {
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let table: Vec<f32> = (0..1 << 16)
        .map(|_| (next() % 2001) as f32 / 20000.0 - 0.05)
        .collect();
    let bf16_table: Vec<u8> = table
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect();
    let f32_table: Vec<u8> = table.iter().flat_map(|v| v.to_le_bytes()).collect();
    let data: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, dt, shape)| {
            let t = if *dt == Dtype::BF16 {
                &bf16_table
            } else {
                &f32_table
            };
            let len = shape.iter().product::<usize>() * dt.bitsize() / 8;
            let mut v = Vec::with_capacity(len);
            while v.len() < len {
                let start = (next() as usize % (t.len() / 2)) & !3;
                let n = (len - v.len()).min(t.len() - start);
                v.extend_from_slice(&t[start..start + n]);
            }
            v
        })
        .collect();
    let views = tensors.iter().zip(&data).map(|((n, dt, shape), d)| {
        (
            n.clone(),
            safetensors::tensor::TensorView::new(*dt, shape.clone(), d).unwrap(),
        )
    });
    safetensors::serialize_to_file(views, None, path).unwrap();
}

const SYN_COLS: usize = 4096;

/// A synthetic sharded bf16 base: `shards` files, each holding one up_proj of
/// `mib_per_shard` MiB and a norm; the last also an lm_head of 16 MiB. And an adapter: rank-8
/// LoRA on every up_proj (f32) plus lm_head in modules_to_save (f32, 32 MiB).
fn synthetic(dir: &Path, shards: usize, mib_per_shard: usize) -> (PathBuf, PathBuf) {
    let base = dir.join("base");
    let adapter = dir.join("adapter");
    std::fs::create_dir_all(&base).unwrap();
    std::fs::create_dir_all(&adapter).unwrap();
    let rows = (mib_per_shard << 20) / 2 / SYN_COLS;
    let head = [2048, SYN_COLS];
    let mut weight_map = serde_json::Map::new();
    let mut lora = Vec::new();
    for i in 0..shards {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, shards);
        let mut t = vec![
            (
                format!("model.layers.{i}.mlp.up_proj.weight"),
                Dtype::BF16,
                vec![rows, SYN_COLS],
            ),
            (
                format!("model.layers.{i}.post_attention_layernorm.weight"),
                Dtype::BF16,
                vec![SYN_COLS],
            ),
        ];
        if i + 1 == shards {
            t.push(("lm_head.weight".into(), Dtype::BF16, head.to_vec()));
        }
        write_synthetic(&base.join(&file), &t, 11 + i as u64);
        for (n, _, _) in &t {
            weight_map.insert(n.clone(), file.clone().into());
        }
        let m = format!("base_model.model.model.layers.{i}.mlp.up_proj");
        lora.push((format!("{m}.lora_A.weight"), Dtype::F32, vec![8, SYN_COLS]));
        lora.push((format!("{m}.lora_B.weight"), Dtype::F32, vec![rows, 8]));
    }
    lora.push((
        "base_model.model.lm_head.weight".into(),
        Dtype::F32,
        head.to_vec(),
    ));
    write_synthetic(&adapter.join("adapter_model.safetensors"), &lora, 99);
    std::fs::write(
        base.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": weight_map}).to_string(),
    )
    .unwrap();
    std::fs::write(
        base.join("config.json"),
        r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16"}"#,
    )
    .unwrap();
    std::fs::write(
        adapter.join("adapter_config.json"),
        r#"{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["up_proj"],
            "modules_to_save": ["lm_head"], "base_model_name_or_path": "synthetic"}"#,
    )
    .unwrap();
    (base, adapter)
}

fn merge_cmd(base: &Path, adapter: &Path, out: &Path) -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_mole-worker"));
    c.args(["merge", "--safe-merge", "--base"])
        .arg(base)
        .arg("--adapter")
        .arg(adapter)
        .arg("--out")
        .arg(out)
        .env("MOLE_MERGE_REPORT_RSS", "1");
    c
}

/// Every file of a directory: name → bytes.
fn dir_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

#[test]
fn a_killed_merge_leaves_no_output_and_a_rerun_completes_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, adapter) = synthetic(tmp.path(), 3, 48);
    let work = tmp.path().join("merged");
    std::fs::create_dir_all(&work).unwrap();
    let out = work.join("out");
    let mut child = merge_cmd(&base, &adapter, &out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Kill it once it has started writing the second shard: mid-run, output half done.
    let started = std::time::Instant::now();
    let second_shard = loop {
        let tmp_dir = std::fs::read_dir(&work)
            .unwrap()
            .flatten()
            .find(|e| e.file_name().to_string_lossy().starts_with(".out.tmp-"));
        if let Some(d) = tmp_dir {
            if d.path().join("model-00002-of-00003.safetensors").exists() {
                break true;
            }
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the merge ended ({status}) before it could be interrupted");
        }
        assert!(
            started.elapsed().as_secs() < 120,
            "the merge never got going"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    assert!(second_shard);
    child.kill().unwrap(); // SIGKILL: no cleanup runs.
    child.wait().unwrap();
    assert!(!out.exists(), "a killed merge leaves no output directory");
    let left: Vec<String> = std::fs::read_dir(&work)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(
        left[0].starts_with(".out.tmp-"),
        "only a temporary sibling: {left:?}"
    );

    let rerun = merge_cmd(&base, &adapter, &out).output().unwrap();
    assert!(
        rerun.status.success(),
        "{}",
        String::from_utf8_lossy(&rerun.stderr)
    );
    let left: Vec<_> = std::fs::read_dir(&work).unwrap().flatten().collect();
    assert_eq!(left.len(), 1, "the stale temporary directory is gone");

    // The rerun's output is the uninterrupted merge's, byte for byte.
    let reference = tmp.path().join("reference");
    merge(&MergeOptions {
        base: base.clone(),
        adapter: adapter.clone(),
        out: reference.clone(),
        safe_merge: true,
        dtype: None,
        root: None,
        expect_base: None,
        max_rank: 64,
        adapter_name: None,
        adapter_version: None,
    })
    .unwrap();
    let (mut ours, mut want) = (dir_files(&out), dir_files(&reference));
    for m in [&mut ours, &mut want] {
        let meta: serde_json::Value =
            serde_json::from_slice(&m.remove("merge_metadata.json").unwrap()).unwrap();
        assert_eq!(meta["modules_merged"], 3);
    }
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (name, bytes) in &ours {
        assert!(*bytes == want[name], "{name} differs");
    }
}

#[test]
fn peak_rss_stays_within_largest_shard_plus_adapter_plus_256_mib_and_the_output_is_exact() {
    // Three ~100 MiB shards; every large tensor is changed (LoRA on up_proj, lm_head
    // replaced), which is when a merge is tempted to hold whole tensors in f32.
    let tmp = tempfile::tempdir().unwrap();
    let (base, adapter) = synthetic(tmp.path(), 3, 100);
    let out = tmp.path().join("out");
    let o = merge_cmd(&base, &adapter, &out).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let peak: u64 = stderr
        .lines()
        .find_map(|l| l.strip_prefix("peak_rss_bytes "))
        .expect("MOLE_MERGE_REPORT_RSS prints the peak")
        .trim()
        .parse()
        .unwrap();
    let size = |p: PathBuf| std::fs::metadata(p).unwrap().len();
    let largest = (1..=3)
        .map(|i| size(base.join(format!("model-{i:05}-of-00003.safetensors"))))
        .max()
        .unwrap();
    let adapter_bytes = size(adapter.join("adapter_model.safetensors"));
    let budget = largest + adapter_bytes + (256 << 20);
    let mib = |b: u64| b >> 20;
    eprintln!(
        "peak RSS {} MiB; budget {} MiB (largest shard {} + adapter {} + 256)",
        mib(peak),
        mib(budget),
        mib(largest),
        mib(adapter_bytes)
    );
    assert!(
        peak <= budget,
        "peak RSS {} MiB over the budget {} MiB",
        mib(peak),
        mib(budget)
    );
    assert_streamed_output_is_exact(&base, &adapter, &out, 3);
}

/// Checks the output of merging [`synthetic`]: every row of every up_proj (the merge writes
/// them in parallel blocks, at computed offsets, over many windows) holds its own merged
/// values within one bf16 ulp of the exact f64 result, sampled columns of every row and every
/// column of a few rows; norms are the base's bytes; lm_head is the adapter's, in bf16.
fn assert_streamed_output_is_exact(base: &Path, adapter: &Path, out: &Path, shards: usize) {
    let ad = read_file_tensors(&adapter.join("adapter_model.safetensors"));
    let f32s = |t: &(Dtype, Vec<usize>, Vec<u8>)| to_f32(t.0, &t.2).unwrap();
    let scale = 16.0 / 8.0;
    for i in 0..shards {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, shards);
        let want = read_file_tensors(&base.join(&file));
        let got = read_file_tensors(&out.join(&file));
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>()
        );
        let norm = format!("model.layers.{i}.post_attention_layernorm.weight");
        assert_eq!(got[&norm], want[&norm], "{norm} is copied unchanged");
        let up = format!("model.layers.{i}.mlp.up_proj.weight");
        let m = format!("base_model.model.model.layers.{i}.mlp.up_proj");
        let a = f32s(&ad[&format!("{m}.lora_A.weight")]);
        let b = f32s(&ad[&format!("{m}.lora_B.weight")]);
        let (w, o) = (&want[&up].2, &got[&up].2);
        let rows = want[&up].1[0];
        let bf = |bytes: &[u8], at: usize| u16::from_le_bytes([bytes[2 * at], bytes[2 * at + 1]]);
        let mut checked = 0;
        for r in 0..rows {
            let cols: Vec<usize> = if r == 0 || r == rows / 2 || r == rows - 1 {
                (0..SYN_COLS).collect()
            } else {
                vec![0, 1, 63, 64, 2047, SYN_COLS - 1, (r * 7919) % SYN_COLS]
            };
            for c in cols {
                let at = r * SYN_COLS + c;
                let d: f64 = (0..8)
                    .map(|k| b[r * 8 + k] as f64 * a[k * SYN_COLS + c] as f64)
                    .sum();
                let exact = half::bf16::from_bits(bf(w, at)).to_f64() + scale * d;
                let ulps = bf16_ulp_distance(bf(o, at), half::bf16::from_f64(exact).to_bits());
                assert!(
                    ulps <= 1,
                    "{up}[{r}, {c}]: {} is {ulps} bf16 ulps from the exact {exact}",
                    half::bf16::from_bits(bf(o, at))
                );
                checked += 1;
            }
        }
        assert!(checked > rows * 7);
        if i + 1 == shards {
            let head = &got["lm_head.weight"].2;
            let want: Vec<u8> = f32s(&ad["base_model.model.lm_head.weight"])
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect();
            assert!(*head == want, "lm_head is the adapter's, rounded to bf16");
        }
    }
}

/// A Qwen3-VL adapter (on the language model, under `model.language_model.`) merged into the
/// checkpoint: every tensor PEFT's `merge_and_unload()` changes within 1e-6 of its scale, every
/// other one (the vision tower included) the base's bytes; and the merged model, served with
/// an image and no adapter, answers as the base with the adapter does in transformers.
#[test]
fn qwen3_vl_merges_match_peft_and_serve_images_as_the_adapter() {
    use mole_engine::api::{
        ChatMessage, ContentPart, GenerateRequest, Image, Prompt, PromptCodec, SamplingParams,
        Serving, TokenEvent,
    };
    use sha2::Digest;
    let vision = fixtures().join("../vision");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("merged");
    let o = MergeOptions {
        base: vision.join("qwen3_vl"),
        adapter: vision.join("adapter"),
        expect_base: Some("qwen3-vl-tiny".into()),
        ..opts("base_f32", "plain_r8", &out)
    };
    merge(&o).unwrap();
    let ours = read_dir_tensors(&out);
    let base = read_dir_tensors(&vision.join("qwen3_vl"));
    let peft = read_file_tensors(&vision.join("peft_merged.safetensors"));
    assert_eq!(ours.len(), base.len());
    for (name, (dt, shape, bytes)) in &ours {
        match peft.get(name) {
            Some((pdt, pshape, pbytes)) => {
                assert_eq!((dt, shape), (pdt, pshape), "{name}");
                let worst =
                    scaled_error(&to_f32(*dt, bytes).unwrap(), &to_f32(*pdt, pbytes).unwrap());
                assert!(worst <= 1e-6, "{name}: relative error {worst}");
            }
            None => assert_eq!(bytes, &base[name].2, "{name} changed but PEFT's did not"),
        }
    }
    assert_eq!(peft.len(), 21);
    // Served from the merged weights (the tokenizer, template and image processor come
    // along): transformers' tokens with the adapter.
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
    ] {
        assert!(out.join(f).exists(), "{f} not copied into the merged model");
    }
    let e = mole_engine::Engine::load(
        &ModelSource::hf(out, candle_core::DType::F32),
        &candle_core::Device::Cpu,
        mole_engine::EngineOptions {
            // The references were computed with transformers' PIL backend.
            image_processor: mole_api::ImageProcessor::Pil,
            ..Default::default()
        },
    )
    .unwrap();
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(vision.join("chat_reference.json")).unwrap())
            .unwrap();
    let c = &r["infer_one_image"];
    let png = std::fs::read(vision.join("images/square.png")).unwrap();
    let rgb = image::load_from_memory(&png).unwrap().to_rgb8();
    let img = Image {
        width: rgb.width(),
        height: rgb.height(),
        rgb: std::sync::Arc::from(rgb.into_raw()),
        digest: sha2::Sha256::digest(&png).into(),
    };
    let mut msg = ChatMessage::text("user", "What is on the screen?");
    msg.parts = vec![
        ContentPart::Image,
        ContentPart::Text("What is on the screen?".into()),
    ];
    let text = e.apply_chat_template(&[msg], &Default::default()).unwrap();
    let mut rx = e
        .submit(GenerateRequest {
            id: "m".into(),
            prompt: Prompt::Templated(text),
            adapter: None,
            sampling: SamplingParams {
                max_tokens: 8,
                ignore_eos: true,
                ..Default::default()
            },
            images: vec![img],
        })
        .unwrap();
    let mut tokens = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            TokenEvent::Token { token_id, .. } => tokens.push(token_id),
            TokenEvent::Finished { .. } => break,
            TokenEvent::Error(err) => panic!("{err}"),
            TokenEvent::Started { .. } => {}
        }
    }
    let want: Vec<u32> = serde_json::from_value(c["adapter"]["greedy"].clone()).unwrap();
    assert_eq!(tokens, want);
}

/// PEFT's `all-linear` adapter on Qwen3-VL, vision tower included (attention, MLPs, mergers):
/// all 39 merged tensors within 1e-6 of PEFT's, everything else the base's bytes.
#[test]
fn qwen3_vl_all_linear_merges_match_peft_vision_tower_included() {
    let vision = fixtures().join("../vision");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("merged");
    merge(&MergeOptions {
        base: vision.join("qwen3_vl"),
        adapter: vision.join("adapter_all_linear"),
        expect_base: Some("qwen3-vl-tiny".into()),
        ..opts("base_f32", "plain_r8", &out)
    })
    .unwrap();
    let ours = read_dir_tensors(&out);
    let base = read_dir_tensors(&vision.join("qwen3_vl"));
    let peft = read_file_tensors(&vision.join("peft_merged_all_linear.safetensors"));
    assert_eq!(peft.len(), 39);
    assert!(peft.keys().any(|k| k.starts_with("model.visual.blocks.")));
    for (name, (dt, shape, bytes)) in &ours {
        match peft.get(name) {
            Some((pdt, pshape, pbytes)) => {
                assert_eq!((dt, shape), (pdt, pshape), "{name}");
                let worst =
                    scaled_error(&to_f32(*dt, bytes).unwrap(), &to_f32(*pdt, pbytes).unwrap());
                assert!(worst <= 1e-6, "{name}: relative error {worst}");
            }
            None => assert_eq!(bytes, &base[name].2, "{name} changed but PEFT's did not"),
        }
    }
}
