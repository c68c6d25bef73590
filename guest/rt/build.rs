// The link flags (.cargo/config.toml) point every guest binary at ../link.ld;
// rerunning this script when it changes rebuilds ftvm-rt, which relinks them.
fn main() {
    println!("cargo:rerun-if-changed=../link.ld");
}
