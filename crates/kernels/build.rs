//! With the `cuda` feature, compiles `csrc/kernels.cu` into one fat binary: SASS for sm_90a (H100,
//! H200: nothing to JIT at start) plus compute_90 PTX for newer GPUs. `RSERVE_CUDA_GENCODE`
//! replaces the target list (e.g. `arch=compute_80,code=sm_80`, several separated by `;`).
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
}
