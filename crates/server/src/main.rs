//! The `rserve` binary; see the library for the commands.

fn main() {
    if let Err(e) = rserve_server::main_with_args(std::env::args_os()) {
        eprintln!("Error: {e:#}");
        std::process::exit(1);
    }
}
