//! Where the benchmark finds the programs and guest images it runs: next
//! to itself, in the `target/` it was built into.

use std::path::PathBuf;

/// A binary next to this one (target/release/NAME).
pub fn sibling_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("own path");
    exe.parent().expect("in a directory").join(name)
}

/// target/images, two levels above the binaries.
pub fn images() -> PathBuf {
    let exe = std::env::current_exe().expect("own path");
    exe.parent().and_then(|p| p.parent()).expect("inside target/").join("images")
}
