//! Under the `cuda` feature, compiles the worker's own CUDA kernels (`kernels/*.cu`) to PTX in
//! OUT_DIR, which `src/bgmv.rs` embeds and loads through candle's custom-function
//! loader. PTX rather than a cubin: the driver compiles it for whatever GPU runs it, as it
//! does candle's own kernels. Without the feature it does nothing (no toolkit needed).
//!
//! The toolkit: `NVCC`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on the PATH (the PyPI one of
//! ../shared/tools/cuda13-from-pypi.sh works; keep it at 13.0.x, whose PTX driver 580 loads).
//! The target: `CUDA_COMPUTE_CAP` (e.g. 90 for H100/H200), as candle's kernels take it, else
//! what `nvidia-smi` reports.

use std::path::{Path, PathBuf};
use std::process::Command;

const KERNELS: &[&str] = &["lora"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for k in KERNELS {
        println!("cargo:rerun-if-changed=kernels/{k}.cu");
    }
    for v in ["NVCC", "CUDA_HOME", "CUDA_PATH", "CUDA_COMPUTE_CAP"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = nvcc();
    let cap = compute_cap(&nvcc);
    for k in KERNELS {
        let src = Path::new("kernels").join(format!("{k}.cu"));
        let ptx = out.join(format!("{k}.ptx"));
        // -O3 and no --use_fast_math: fast-math flushes subnormals and contracts freely, and
        // the CPU reference (src/bgmv.rs) repeats these kernels' arithmetic exactly.
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17", "--fmad=true"])
            .arg(format!("-arch=compute_{cap}"))
            .arg(&src)
            .arg("-o")
            .arg(&ptx)
            .status()
            .unwrap_or_else(|e| fail(&format!("cannot run {}: {e}", nvcc.display())));
        if !status.success() {
            fail(&format!(
                "{} failed on {} ({status})",
                nvcc.display(),
                src.display()
            ));
        }
    }
}

/// The nvcc to run, or a build failure that says where it was looked for.
fn nvcc() -> PathBuf {
    if let Some(n) = std::env::var_os("NVCC") {
        return n.into();
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var) {
            let n = Path::new(&home).join("bin/nvcc");
            if n.is_file() {
                return n;
            }
        }
    }
    if Command::new("nvcc").arg("--version").output().is_ok() {
        return "nvcc".into();
    }
    fail(
        "the `cuda` feature compiles crates/kernels/kernels/*.cu with nvcc, and none was found: set \
         CUDA_HOME (or NVCC) to a CUDA 13.0 toolkit, e.g. the PyPI one that \
         ../shared/tools/cuda13-from-pypi.sh installs (see CONTRIBUTING.md, GPU runs)",
    )
}

/// The compute capability to write PTX for, as digits (`90`).
fn compute_cap(nvcc: &Path) -> String {
    if let Ok(c) = std::env::var("CUDA_COMPUTE_CAP") {
        let c = c.trim().trim_end_matches(['a', 'f']).replace('.', "");
        if !c.is_empty() && c.chars().all(|d| d.is_ascii_digit()) {
            return c;
        }
        fail(&format!(
            "CUDA_COMPUTE_CAP={c:?}: expected digits such as 90"
        ));
    }
    let smi = Command::new("nvidia-smi")
        .args(["--query-gpu=compute_cap", "--format=csv,noheader"])
        .output();
    if let Ok(o) = smi {
        let s = String::from_utf8_lossy(&o.stdout);
        if let Some(line) = s.lines().next().filter(|_| o.status.success()) {
            let c = line.trim().replace('.', "");
            if !c.is_empty() && c.chars().all(|d| d.is_ascii_digit()) {
                return c;
            }
        }
    }
    fail(&format!(
        "no GPU to ask for its compute capability: set CUDA_COMPUTE_CAP (90 for H100/H200) \
         for {}",
        nvcc.display()
    ))
}

fn fail(why: &str) -> ! {
    eprintln!("error: mole-worker build: {why}");
    std::process::exit(1)
}
