//! The crate must build for the guest, which has no std. `#![no_std]`
//! makes any use of std a compile error unless std is linked explicitly, so
//! check that nothing does, and that dependencies stay without their
//! std-requiring default features.

use std::fs;
use std::path::Path;

fn sources(dir: &Path, out: &mut Vec<(String, String)>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push((path.display().to_string(), fs::read_to_string(&path).unwrap()));
        }
    }
}

#[test]
fn library_is_no_std() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = fs::read_to_string(root.join("src/lib.rs")).unwrap();
    assert!(lib.lines().any(|l| l.trim() == "#![no_std]"), "lib.rs must be unconditionally no_std");
    let mut files = Vec::new();
    sources(&root.join("src"), &mut files);
    assert!(files.len() > 5);
    for (path, text) in files {
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap();
            let uses_std = code.contains("extern crate std")
                || code.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).any(|w| w.starts_with("std::"));
            assert!(!uses_std, "{path}:{}: {line}", n + 1);
        }
    }
    let manifest = fs::read_to_string(root.join("Cargo.toml")).unwrap();
    for line in manifest.lines().filter(|l| l.contains("version =") && l.contains('{')) {
        assert!(line.contains("default-features = false"), "dependency with default features: {line}");
    }
}
