//! The `rserve` binary; see the library for the commands.

fn main() {
    rserve_core::engine::mark_process_start();
    // candle's CUDA modules load as SASS built for sm_90 (`candle_sass`); on other GPUs their PTX is
    // compiled by the driver at first use and cached: give that cache room for all of them so only
    // the first start on a machine pays. Set here, before any thread exists.
    if std::env::var_os("CUDA_CACHE_MAXSIZE").is_none() {
        std::env::set_var("CUDA_CACHE_MAXSIZE", "4294967296");
    }
    if let Err(e) = rserve_server::main_with_args(std::env::args_os()) {
        eprintln!("Error: {e:#}");
        std::process::exit(1);
    }
}
