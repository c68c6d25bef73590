//! What a vCPU's saved state depends on in its host, so that two hosts can
//! tell before a replication starts whether one can restore the other's
//! vCPUs: the CPU features the VMM gives the guest (code compiled or
//! dispatched for AVX keeps using it after a failover), the XSAVE features
//! it enables and the size of their save area, and the MSRs it saves.
//! Restoring needs, on the restoring host, every one of these at least.

use kvm_bindings::CpuId;
use serde::{Deserialize, Serialize};

/// CPUID feature words: (leaf, subleaf, register index into
/// `[eax, ebx, ecx, edx]`, bits that are state rather than features).
const FEATURE_WORDS: &[(u32, u32, usize, u32)] = &[
    (0x1, 0, 2, 1 << 27),   // ECX; OSXSAVE mirrors CR4
    (0x1, 0, 3, 0),         // EDX
    (0x7, 0, 1, 0),         // EBX
    (0x7, 0, 2, 1 << 4),    // ECX; OSPKE mirrors CR4
    (0x7, 0, 3, 0),         // EDX
    (0x7, 1, 0, 0),         // EAX
    (0xd, 0, 0, 0),         // EAX: XCR0 bits supported (low)
    (0xd, 0, 3, 0),         // EDX: XCR0 bits supported (high)
    (0xd, 1, 0, 0),         // EAX: XSAVEOPT, XSAVEC, XGETBV1, XSAVES
    (0x8000_0001, 0, 2, 0), // ECX
    (0x8000_0001, 0, 3, 0), // EDX
];

const REGISTERS: [&str; 4] = ["EAX", "EBX", "ECX", "EDX"];

/// One CPUID feature word as the vCPUs see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FeatureWord {
    pub leaf: u32,
    pub subleaf: u32,
    /// 0..4: EAX, EBX, ECX, EDX.
    pub register: u8,
    pub bits: u32,
}

/// The host-dependent part of a vCPU's saved state, as this VMM sets it up.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuProfile {
    pub features: Vec<FeatureWord>,
    /// XSAVE features the VMM enables in XCR0 (`cpu::xcr0_for`); 0: no XSAVE.
    pub xcr0: u64,
    /// Bytes of the XSAVE area for every feature the vCPUs support
    /// (CPUID 0xD.0 ECX).
    pub xsave_size: u32,
    /// The MSRs saved with each vCPU (`vcpu::saveable_msrs`), sorted.
    pub msrs: Vec<u32>,
}

impl CpuProfile {
    /// The profile of vCPUs configured with `cpuid` that save `msrs`.
    pub fn new(cpuid: &CpuId, msrs: &[u32]) -> CpuProfile {
        let entries = cpuid.as_slice();
        let features = FEATURE_WORDS
            .iter()
            .map(|&(leaf, subleaf, register, state)| {
                let e = entries.iter().find(|e| e.function == leaf && e.index == subleaf);
                let regs = e.map_or([0; 4], |e| [e.eax, e.ebx, e.ecx, e.edx]);
                FeatureWord { leaf, subleaf, register: register as u8, bits: regs[register] & !state }
            })
            .collect();
        let xsave_size = entries.iter().find(|e| e.function == 0xd && e.index == 0).map_or(0, |e| e.ecx);
        let mut msrs = msrs.to_vec();
        msrs.sort_unstable();
        CpuProfile { features, xcr0: super::cpu::xcr0_for(cpuid).unwrap_or(0), xsave_size, msrs }
    }

    /// Whether vCPUs of this profile (this host) can restore the state of
    /// vCPUs of `theirs`, or the first reason why not, in words.
    pub fn can_restore(&self, theirs: &CpuProfile) -> Result<(), String> {
        for t in &theirs.features {
            let ours =
                self.features.iter().find(|o| (o.leaf, o.subleaf, o.register) == (t.leaf, t.subleaf, t.register)).map_or(0, |o| o.bits);
            let missing = t.bits & !ours;
            if missing != 0 {
                let reg = REGISTERS.get(t.register as usize).unwrap_or(&"?");
                return Err(format!("CPUID {:#x}.{} {reg} feature bits {missing:#010x} are missing here", t.leaf, t.subleaf));
            }
        }
        let missing = theirs.xcr0 & !self.xcr0;
        if missing != 0 {
            return Err(format!("XSAVE features {missing:#x} (XCR0) are missing here"));
        }
        if theirs.xsave_size > self.xsave_size {
            return Err(format!("its XSAVE area has {} bytes, this host's {}", theirs.xsave_size, self.xsave_size));
        }
        let missing: Vec<String> = theirs.msrs.iter().filter(|m| self.msrs.binary_search(m).is_err()).map(|m| format!("{m:#x}")).collect();
        if !missing.is_empty() {
            return Err(format!("{} MSRs it saves cannot be restored here ({})", missing.len(), missing.join(", ")));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use kvm_bindings::kvm_cpuid_entry2;

    use super::*;

    fn cpuid(entries: &[(u32, u32, [u32; 4])]) -> CpuId {
        let e: Vec<kvm_cpuid_entry2> = entries
            .iter()
            .map(|&(function, index, [eax, ebx, ecx, edx])| kvm_cpuid_entry2 { function, index, eax, ebx, ecx, edx, ..Default::default() })
            .collect();
        CpuId::from_entries(&e).unwrap()
    }

    fn host() -> CpuProfile {
        let xsave = 1 << 26;
        CpuProfile::new(
            &cpuid(&[(1, 0, [0, 0, xsave | (1 << 27), 0xff]), (7, 0, [0, 0b101, 0, 0]), (0xd, 0, [0b111, 832, 1088, 0])]),
            &[0x10, 0xc000_0080, 0x174],
        )
    }

    #[test]
    fn a_host_restores_its_own_vcpus_and_those_of_a_lesser_one() {
        let ours = host();
        assert_eq!(ours.can_restore(&ours), Ok(()));
        assert_eq!(ours.xcr0, 0b111);
        assert_eq!(ours.xsave_size, 1088);
        assert_eq!(ours.msrs, [0x10, 0x174, 0xc000_0080]);
        // OSXSAVE is state, not a feature.
        assert_eq!(ours.features[0].bits & (1 << 27), 0);
        let mut lesser = ours.clone();
        lesser.features[2].bits = 0b1;
        lesser.msrs.pop();
        lesser.xsave_size = 576;
        assert_eq!(ours.can_restore(&lesser), Ok(()));
    }

    #[test]
    fn each_missing_piece_is_named() {
        let ours = host();
        let mut more = ours.clone();
        more.features[2].bits |= 1 << 5;
        assert_eq!(ours.can_restore(&more).unwrap_err(), "CPUID 0x7.0 EBX feature bits 0x00000020 are missing here");
        let mut more = ours.clone();
        more.xsave_size = 2696;
        assert_eq!(ours.can_restore(&more).unwrap_err(), "its XSAVE area has 2696 bytes, this host's 1088");
        let mut more = ours.clone();
        more.xcr0 |= 0xe0;
        assert!(ours.can_restore(&more).unwrap_err().contains("XSAVE features 0xe0"));
        let mut more = ours.clone();
        more.msrs.push(0x6e0);
        assert_eq!(ours.can_restore(&more).unwrap_err(), "1 MSRs it saves cannot be restored here (0x6e0)");
    }
}
