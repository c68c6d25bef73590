//! x86-64 specifics: system structures in guest memory and initial vCPU state.

pub mod compat;
pub mod cpu;
pub mod layout;
pub mod tables;
