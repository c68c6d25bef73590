//! A Redis-protocol server in a VM on a private topology, unreplicated or
//! protected by a backup, as the kv and cost benchmarks run it.
//!
//! The VMM runs the guest in `NAME-h1` (guest 10.0.0.2 behind tap0 on
//! br0); protected, its backup runs in `NAME-h2` and they replicate over
//! the hosts' link; redis-benchmark runs in `NAME-client`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ftvm_testkit::process::Process;
use ftvm_testkit::topology::{Topology, GUEST_ADDR, GUEST_MAC, H2_REPL_ADDR};

use crate::paths::sibling_binary;

type BoxError = Box<dyn std::error::Error>;

/// The port every server listens on.
pub const PORT: &str = "6379";
const BACKUP_ADDR_PORT: &str = "7000";

/// redis-server's options, in the guest and natively: no persistence.
pub const REDIS_ARGS: [&str; 8] = ["--port", PORT, "--save", "''", "--appendonly", "no", "--protected-mode", "no"];

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum App {
    Kv,
    Redis,
}

impl App {
    pub fn name(self) -> &'static str {
        match self {
            App::Kv => "kv",
            App::Redis => "redis",
        }
    }

    /// The guest image and what builds it.
    pub fn image(self, images: &Path) -> (PathBuf, &'static str) {
        match self {
            App::Kv => (images.join("kv.elf"), "scripts/build-images.sh"),
            App::Redis => (images.join("redis-server"), "scripts/build-redis.sh"),
        }
    }

    /// The guest image, absolute (a native server runs it from inside a
    /// namespace), or what to run to build it.
    pub fn existing_image(self, images: &Path) -> Result<PathBuf, BoxError> {
        let (image, build) = self.image(images);
        if !image.exists() {
            return Err(format!("{} missing: run {build}", image.display()).into());
        }
        Ok(image.canonicalize()?)
    }

    /// `ftvm run` arguments after the image: memory and command line, with
    /// extra runtime options `variant` (Linux personality only; its words
    /// starting with `--` are `ftvm run` options, `--memory=MIB` replacing
    /// the default 512; words after a lone `--` are more redis-server
    /// options, after [`REDIS_ARGS`]).
    pub fn run_args(self, variant: &str) -> Vec<String> {
        let words: Vec<&str> = variant.split_whitespace().collect();
        let (options, server) = words.iter().position(|w| *w == "--").map_or((&words[..], &[][..]), |i| (&words[..i], &words[i + 1..]));
        let (vmm, runtime): (Vec<&str>, Vec<&str>) = options.iter().copied().partition(|w| w.starts_with("--"));
        let mut args: Vec<String> = vmm.into_iter().map(String::from).collect();
        let runtime = runtime.join(" ");
        let memory = if args.iter().any(|a| a.starts_with("--memory=")) { vec![] } else { vec!["--memory".into(), "512".into()] };
        let server = REDIS_ARGS.iter().chain(server).copied().collect::<Vec<_>>().join(" ");
        match self {
            App::Kv => args.extend(["--cmdline".into(), format!("ip={GUEST_ADDR}/24")]),
            App::Redis => args.extend(
                memory
                    .into_iter()
                    .chain(["--cmdline".into(), format!("{runtime} ip={GUEST_ADDR}/24 -- redis-server {server}").trim_start().to_string()]),
            ),
        }
        args
    }
}

/// How a guest is protected: its primary's API socket in `dir`, with
/// `--epoch-ms` (none: the default) and more `ftvm run` options `extra`.
pub struct Protection<'a> {
    pub dir: &'a Path,
    pub epoch_ms: Option<u64>,
    pub extra: &'a [String],
}

/// The guest's VMM, and with protection its backup.
pub struct Guest {
    pub vmm: Process,
    pub backup: Option<Process>,
}

impl Guest {
    /// Start the guest (`variant`: see [`App::run_args`]) and, protected,
    /// its backup, returning once it is protected.
    pub fn start(
        topo: &Topology,
        ftvm: &Path,
        image: &Path,
        app: App,
        variant: &str,
        protect: Option<Protection>,
    ) -> Result<Guest, BoxError> {
        let net = format!("tap=tap0,mac={GUEST_MAC}");
        let backup_addr = format!("{H2_REPL_ADDR}:{BACKUP_ADDR_PORT}");
        let backup = match protect {
            Some(_) => {
                let mut cmd = topo.command("h2", ftvm);
                cmd.args(["backup", "--insecure", "--listen", &backup_addr, "--net", &net]);
                Some(Process::spawn_collected("ftvm backup", &mut cmd)?)
            }
            None => None,
        };
        let mut cmd = topo.command("h1", ftvm);
        cmd.arg("run").arg("--image").arg(image).args(app.run_args(variant)).args(["--net", &net]);
        if let Some(p) = &protect {
            cmd.args(["--insecure", "--replicate-to", &backup_addr, "--api-socket"]).arg(p.dir.join("primary.sock")).args(p.extra);
            if let Some(ms) = p.epoch_ms {
                cmd.args(["--epoch-ms", &ms.to_string()]);
            }
        }
        let vmm = Process::spawn_collected(&format!("ftvm ({})", app.name()), &mut cmd)?;
        let mut guest = Guest { vmm, backup };
        if let Some(p) = protect {
            guest.wait_protected(ftvm, &p.dir.join("primary.sock"))?;
        }
        Ok(guest)
    }

    fn wait_protected(&mut self, ftvm: &Path, socket: &Path) -> Result<(), BoxError> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            self.check_alive()?;
            let out = std::process::Command::new(ftvm).args(["status", "--api-socket"]).arg(socket).output()?;
            if String::from_utf8_lossy(&out.stdout).contains("protected: yes") {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("the guest was not protected within 30 s: {}", self.vmm.output()).into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Fails if the VMM or its backup has exited.
    pub fn check_alive(&mut self) -> Result<(), BoxError> {
        check_alive(&mut self.vmm)?;
        if let Some(b) = &mut self.backup {
            check_alive(b)?;
        }
        Ok(())
    }
}

/// Fails if `server` has exited.
pub fn check_alive(server: &mut Process) -> Result<(), BoxError> {
    match server.try_wait() {
        Some(status) => Err(format!("{} exited ({status}): {}", server.name(), server.output()).into()),
        None => Ok(()),
    }
}

/// Wait until redis-cli PING at `addr` answers PONG.
pub fn wait_serving(topo: &Topology, addr: &str, server: &mut Process) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        check_alive(server)?;
        if topo.redis_cli(addr, &["PING"]).1.trim() == "PONG" {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("{} at {addr} does not answer PING: {}", server.name(), server.output()).into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The ftvm binary: `given`, or the one next to ftvm-bench.
pub fn ftvm_binary(given: Option<&Path>) -> Result<PathBuf, BoxError> {
    let path = given.map_or_else(|| sibling_binary("ftvm"), Path::to_path_buf);
    if !path.exists() {
        return Err(format!("{} missing: build with cargo build --release (or pass --ftvm)", path.display()).into());
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_variant_splits_into_vmm_runtime_and_server_options() {
        let args = App::Redis.run_args("--memory=1024 vdso=off -- --bind 10.0.0.2");
        assert_eq!(args[0], "--memory=1024");
        assert_eq!(args[1], "--cmdline");
        assert_eq!(args[2], format!("vdso=off ip={GUEST_ADDR}/24 -- redis-server {} --bind 10.0.0.2", REDIS_ARGS.join(" ")));
        let plain = App::Redis.run_args("");
        assert_eq!(plain[..2], ["--memory", "512"]);
        assert!(plain[3].ends_with("--protected-mode no"), "{plain:?}");
    }
}
