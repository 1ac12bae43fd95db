//! candle's own CUDA ops served from the SASS built with rserve (no PTX JIT): every module that
//! serving uses loads as SASS and computes what the CPU computes.
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
    // affine, binary, cast, fill, indexing, reduce, sort, ternary, unary
    assert_eq!(modules_loaded_as_sass() - before, 9);
}
