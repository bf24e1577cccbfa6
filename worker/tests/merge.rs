//! mole's merge against PEFT's `merge_and_unload(safe_merge=True)` on committed fixtures
//! (tests/fixtures/merge, written by generate.py), plus every bad input of issue 4.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mole_worker::merge::{bf16_ulp_distance, merge, to_f32, MergeError, MergeOptions, OutDtype};
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
            // Relative to the tensor's largest magnitude: the matmul's summation order differs
            // between torch and candle, which moves single elements by a few f32 ulps of the
            // tensor scale, never more.
            let scale = b
                .iter()
                .fold(0f32, |m, x| m.max(x.abs()))
                .max(f32::MIN_POSITIVE);
            let worst = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs() / scale)
                .fold(0f32, f32::max);
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
