//! A VM as the operator describes it (`ftvm vm create --spec FILE`, TOML).

use serde::{Deserialize, Serialize};

/// How a fleet VM is protected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Protection {
    /// A primary and a backup on two hosts (`ftvm run --replicate-to`).
    #[default]
    PrimaryBackup,
    /// Three consensus-ordered replicas on three hosts (`ftvm replica`):
    /// two run the VM, the third is a witness without one.
    Vsmr,
}

/// One VM of the fleet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmSpec {
    /// Unique in the fleet; also the VM's name at the arbiter.
    pub name: String,
    /// The guest image, a path valid on every host.
    pub image: String,
    #[serde(default = "default_memory")]
    pub memory_mib: u64,
    #[serde(default = "default_vcpus")]
    pub vcpus: u32,
    /// The guest's command line (its address: `ip=A.B.C.D/N`).
    #[serde(default)]
    pub cmdline: String,
    /// The guest network card's MAC address (the same on every host).
    pub mac: String,
    /// A disk of this many MiB: a new zeroed file where the VM starts, and
    /// a replica on its backup's host (replicated with its checkpoints);
    /// with `vsmr`, a new zeroed file for each VM replica (brought up to
    /// date by the leader's full `syncvm`).
    #[serde(default)]
    pub disk_mib: Option<u64>,
    #[serde(default)]
    pub protection: Protection,
    /// More options for the primary's `ftvm run` (`["--epoch-ms", "20"]`),
    /// or with `vsmr` for each VM replica's `ftvm replica`.
    #[serde(default)]
    pub args: Vec<String>,
}

fn default_memory() -> u64 {
    256
}

fn default_vcpus() -> u32 {
    1
}

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("not a VM spec: {0}")]
    Syntax(String),
    #[error("bad VM spec: {0}")]
    Invalid(String),
}

impl VmSpec {
    /// Parse and check a spec file's text.
    pub fn from_toml(text: &str) -> Result<VmSpec, SpecError> {
        let spec: VmSpec = toml::from_str(text).map_err(|e| SpecError::Syntax(e.message().to_string()))?;
        spec.check()?;
        Ok(spec)
    }

    fn check(&self) -> Result<(), SpecError> {
        let bad = |what: String| Err(SpecError::Invalid(what));
        if self.name.is_empty() || self.name.len() > 32 || !self.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
            return bad(format!("name {:?}: 1 to 32 of A-Z, a-z, 0-9, '-', '_'", self.name));
        }
        if self.memory_mib < 16 {
            return bad(format!("memory_mib {}: at least 16", self.memory_mib));
        }
        if self.disk_mib == Some(0) {
            return bad("disk_mib 0: at least 1, or no disk_mib for no disk".into());
        }
        if self.vcpus == 0 {
            return bad("vcpus 0: at least 1".into());
        }
        let octets: Vec<_> = self.mac.split(':').map(|o| u8::from_str_radix(o, 16)).collect();
        if octets.len() != 6 || octets.iter().any(|o| o.is_err()) || self.mac.split(':').any(|o| o.len() != 2) {
            return bad(format!("mac {:?}: six hex octets, as 52:54:00:12:34:56", self.mac));
        }
        if octets[0].as_ref().is_ok_and(|o| o & 1 == 1) {
            return bad(format!("mac {}: a multicast address", self.mac));
        }
        if self.protection == Protection::Vsmr && !self.memory_mib.is_multiple_of(2) {
            return bad(format!("memory_mib {}: a multiple of 2 with protection = \"vsmr\"", self.memory_mib));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
        name = "kv1"
        image = "/images/kv.elf"
        memory_mib = 64
        cmdline = "ip=10.0.0.11/24"
        mac = "52:54:00:00:00:11"
        args = ["--epoch-ms", "20"]
    "#;

    #[test]
    fn a_spec_reads_with_its_defaults() {
        let spec = VmSpec::from_toml(GOOD).unwrap();
        assert_eq!(spec.vcpus, 1);
        assert_eq!(spec.protection, Protection::PrimaryBackup);
        assert_eq!(spec.args, ["--epoch-ms", "20"]);
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        let err = |text: &str| VmSpec::from_toml(text).unwrap_err().to_string();
        assert!(err(&GOOD.replace("kv1", "kv 1")).contains("name \"kv 1\""));
        assert!(err(&GOOD.replace("00:00:00:11", "00:00:11")).contains("six hex octets"));
        assert!(err(&GOOD.replace("52:54", "53:54")).contains("multicast"));
        assert!(err(&GOOD.replace("memory_mib = 64", "memory_mib = 1")).contains("at least 16"));
        assert!(err(&format!("{GOOD}\ndisk_mib = 0")).contains("disk_mib 0"));
        assert!(err(&format!("{GOOD}\ncolour = 1")).contains("unknown field"));
        assert!(err("name = ").starts_with("not a VM spec"));
        assert!(err(&format!("{GOOD}\nprotection = \"raid\"")).contains("unknown variant `raid`"));
    }

    #[test]
    fn a_vsmr_spec_has_an_even_memory() {
        let vsmr = format!("{GOOD}\nprotection = \"vsmr\"\ndisk_mib = 8");
        assert_eq!(VmSpec::from_toml(&vsmr).unwrap().protection, Protection::Vsmr);
        let err = VmSpec::from_toml(&vsmr.replace("memory_mib = 64", "memory_mib = 65")).unwrap_err().to_string();
        assert_eq!(err, "bad VM spec: memory_mib 65: a multiple of 2 with protection = \"vsmr\"");
    }
}
