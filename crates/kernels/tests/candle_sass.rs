//! candle's own CUDA ops served from the SASS built with rserve (no PTX JIT): every module that
//! serving uses (the quantized one included: GGUF types without rserve's kernels) loads as SASS
//! and computes what the CPU computes.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)]

use candle_core::{DType, Device, IndexOp, Tensor, D};
use rserve_kernels::candle_sass::modules_loaded_as_sass;

#[test]
fn candle_modules_load_as_sass_and_match_the_cpu() {
    let gpu = Device::new_cuda(0).unwrap();
    let before = modules_loaded_as_sass();
    let x: Vec<f32> = (0..4096)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    let run = |dev: &Device| -> Vec<Vec<f32>> {
        let t = Tensor::from_vec(x.clone(), (64, 64), dev).unwrap();
        let ids = Tensor::new(&[3u32, 1, 60], dev).unwrap();
        let cast = t
            .to_dtype(DType::BF16)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap(); // cast
        let affine = t.affine(0.5, 1.0).unwrap(); // affine
        let binary = (&t * &cast).unwrap(); // binary
        let unary = t.exp().unwrap().t().unwrap().contiguous().unwrap(); // unary (and ucopy)
        let reduce = t
            .max_keepdim(D::Minus1)
            .unwrap()
            .broadcast_as((64, 64))
            .unwrap(); // reduce
        let ones = Tensor::ones((64, 64), DType::F32, dev).unwrap(); // fill
        let gathered = t.index_select(&ids, 0).unwrap(); // indexing
        let mask = t.ge(0.0).unwrap(); // binary compare
        let chosen = mask.where_cond(&t, &ones).unwrap(); // ternary
        let sorted = t.i(0).unwrap().arg_sort_last_dim(true).unwrap(); // sort
        [
            cast,
            affine,
            binary,
            unary,
            reduce.contiguous().unwrap(),
            ones,
            chosen,
        ]
        .iter()
        .map(|r| r.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .chain([gathered.flatten_all().unwrap().to_vec1::<f32>().unwrap()])
        .chain([sorted
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()])
        .collect()
    };
    let want = run(&Device::Cpu);
    let got = run(&gpu);
    for (w, g) in want.iter().zip(&got) {
        assert_eq!(w.len(), g.len());
        for (a, b) in w.iter().zip(g) {
            assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "{a} vs {b}");
        }
    }
    quantized_products_match_the_cpu(&gpu);
    // affine, binary, cast, fill, indexing, quantized, reduce, sort, ternary, unary
    assert_eq!(modules_loaded_as_sass() - before, 10);
}

/// candle's quantized module (GGUF types without rserve's kernels, `q5_K` and `q3_K` here): a
/// matrix-vector product (activations quantized to 8 bits on the GPU), a product over 8 rows and
/// the dequantized weight, against the same products of the dequantized weight on the CPU.
fn quantized_products_match_the_cpu(gpu: &Device) {
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::Module;
    let (n, k) = (64, 512);
    let w: Vec<f32> = (0..n * k)
        .map(|i| ((i * 53 % 211) as f32 - 105.0) / 70.0)
        .collect();
    let x: Vec<f32> = (0..8 * k)
        .map(|i| ((i * 29 % 97) as f32 - 48.0) / 40.0)
        .collect();
    for dtype in [GgmlDType::Q5K, GgmlDType::Q3K] {
        let cpu_w = Tensor::from_vec(w.clone(), (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&cpu_w, dtype).unwrap();
        let dense = q.dequantize(&Device::Cpu).unwrap();
        let on_gpu = QTensor::quantize(&cpu_w.to_device(gpu).unwrap(), dtype).unwrap();
        let gpu_dense = on_gpu.dequantize(gpu).unwrap();
        let mm = QMatMul::from_qtensor(on_gpu).unwrap();
        let diff = max_abs(&(gpu_dense.to_device(&Device::Cpu).unwrap() - &dense).unwrap());
        assert!(
            diff < 1e-6,
            "{dtype:?}: dequantized on the GPU differs by {diff}"
        );
        for rows in [1, 8] {
            let xs = Tensor::from_vec(x[..rows * k].to_vec(), (rows, k), &Device::Cpu).unwrap();
            let want = xs.matmul(&dense.t().unwrap()).unwrap();
            let got = mm.forward(&xs.to_device(gpu).unwrap()).unwrap();
            let scale = max_abs(&want);
            let err = max_abs(&(got.to_device(&Device::Cpu).unwrap() - &want).unwrap());
            assert!(
                err <= 0.02 * scale,
                "{dtype:?}, {rows} rows: {err} against outputs up to {scale}"
            );
        }
    }
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}
