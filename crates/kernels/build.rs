//! With the `cuda` feature, compiles `csrc/kernels.cu` into one fat binary: SASS for sm_90a (H100,
//! H200: nothing to JIT at start) plus compute_90 PTX for newer GPUs. `RSERVE_CUDA_GENCODE`
//! replaces the target list (e.g. `arch=compute_80,code=sm_80`, several separated by `;`).
//! It also compiles candle's own CUDA modules (the same sources candle ships as PTX) to SASS, which
//! `candle_sass` hands the driver instead of the PTX: `RSERVE_CANDLE_GENCODE` (default sm_90).
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=csrc");
    println!("cargo:rerun-if-env-changed=RSERVE_CUDA_GENCODE");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = std::env::var_os("NVCC")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("CUDA_HOME").map(|h| PathBuf::from(h).join("bin/nvcc")))
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let gencode = std::env::var("RSERVE_CUDA_GENCODE").unwrap_or_else(|_| {
        "arch=compute_90a,code=sm_90a;arch=compute_90,code=compute_90".to_string()
    });
    let out =
        PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR")).join("rserve_kernels.fatbin");
    let mut cmd = Command::new(&nvcc);
    cmd.args(["--fatbin", "-O3", "-std=c++17", "-lineinfo"]);
    for g in gencode.split(';').filter(|g| !g.trim().is_empty()) {
        cmd.arg(format!("-gencode={}", g.trim()));
    }
    cmd.arg("csrc/kernels.cu").arg("-o").arg(&out);
    let status = cmd.status().unwrap_or_else(|e| {
        panic!(
            "running {} failed: {e} (set NVCC or CUDA_HOME)",
            nvcc.display()
        )
    });
    assert!(status.success(), "nvcc failed on csrc/kernels.cu");
    candle_modules(&nvcc);
}

/// candle's CUDA modules that serving uses (conv, which no served model runs, is left to its PTX).
const CANDLE_MODULES: [&str; 10] = [
    "affine",
    "binary",
    "cast",
    "fill",
    "indexing",
    "quantized",
    "reduce",
    "sort",
    "ternary",
    "unary",
];

/// Where cargo unpacked candle-kernels: `RSERVE_CANDLE_KERNELS_SRC`, else the registry copy of the
/// version Cargo.lock pins.
fn candle_kernels_src() -> PathBuf {
    println!("cargo:rerun-if-env-changed=RSERVE_CANDLE_KERNELS_SRC");
    if let Some(p) = std::env::var_os("RSERVE_CANDLE_KERNELS_SRC") {
        return PathBuf::from(p);
    }
    let root = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"))
        .join("../..");
    let lock = std::fs::read_to_string(root.join("Cargo.lock")).expect("reading Cargo.lock");
    let version = lock
        .split("[[package]]")
        .find(|p| p.contains("name = \"candle-kernels\""))
        .and_then(|p| p.lines().find_map(|l| l.strip_prefix("version = \"")))
        .map(|v| v.trim_end_matches('"').to_string())
        .expect("candle-kernels is not in Cargo.lock");
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .expect("CARGO_HOME or HOME");
    let registry = home.join("registry/src");
    std::fs::read_dir(&registry)
        .into_iter()
        .flatten()
        .flatten()
        .map(|d| d.path().join(format!("candle-kernels-{version}/src")))
        .find(|p| p.is_dir())
        .unwrap_or_else(|| {
            panic!(
                "candle-kernels {version} not found under {} (set RSERVE_CANDLE_KERNELS_SRC)",
                registry.display()
            )
        })
}

fn candle_modules(nvcc: &PathBuf) {
    println!("cargo:rerun-if-env-changed=RSERVE_CANDLE_GENCODE");
    let src = candle_kernels_src();
    let gencode = std::env::var("RSERVE_CANDLE_GENCODE")
        .unwrap_or_else(|_| "arch=compute_90,code=sm_90".to_string());
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    // both cores: one nvcc per module, all at once
    let children: Vec<_> = CANDLE_MODULES
        .iter()
        .map(|m| {
            let mut cmd = Command::new(nvcc);
            cmd.args(["--fatbin", "-O3", "-std=c++17", "--expt-relaxed-constexpr"]);
            for g in gencode.split(';').filter(|g| !g.trim().is_empty()) {
                cmd.arg(format!("-gencode={}", g.trim()));
            }
            cmd.arg("-I").arg(&src).arg(src.join(format!("{m}.cu")));
            cmd.arg("-o")
                .arg(out_dir.join(format!("candle_{m}.fatbin")));
            (m, cmd.spawn().expect("starting nvcc"))
        })
        .collect();
    for (m, mut child) in children {
        let status = child.wait().expect("waiting for nvcc");
        assert!(status.success(), "nvcc failed on candle-kernels' {m}.cu");
    }
}
