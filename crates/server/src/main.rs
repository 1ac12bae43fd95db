//! The `rserve` binary; see the library for the commands.

fn main() {
    rserve_core::engine::mark_process_start();
    // candle's own CUDA modules ship as PTX that the driver compiles on first use and caches; give
    // that cache room for all of them so only the first start on a machine pays (~12-15 s on an
    // H200), before `/health`, never inside a request. Set here, before any thread exists.
    if std::env::var_os("CUDA_CACHE_MAXSIZE").is_none() {
        std::env::set_var("CUDA_CACHE_MAXSIZE", "4294967296");
    }
    if let Err(e) = rserve_server::main_with_args(std::env::args_os()) {
        eprintln!("Error: {e:#}");
        std::process::exit(1);
    }
}
