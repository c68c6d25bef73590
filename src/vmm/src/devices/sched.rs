//! How device threads are scheduled against the vCPUs (`--device-sched`).

crate::switch! {
    /// The device threads' scheduling policy.
    pub enum DeviceSched {
        /// SCHED_OTHER, as every other thread: a woken device thread may
        /// preempt the vCPU at once.
        Normal = "normal",
        /// SCHED_BATCH: a device thread woken by host I/O (a frame on the
        /// TAP) does not preempt the thread running on its CPU, typically
        /// the vCPU, but runs on an idle CPU or when that thread blocks or
        /// its time slice ends: meant to spare vCPU context switches,
        /// costly under nested KVM (the vCPU thread's MSR and CR4 reloads),
        /// at the price of the device's wake-up latency on a busy host.
        /// Measured against `normal` on redis-server at `-P 16`, the
        /// difference in CPU per request stayed within the noise, hence
        /// not the default (README, "Where redis-server's time goes").
        Batch = "batch",
    }
}

impl DeviceSched {
    /// Apply the policy to the calling thread (before it installs its
    /// seccomp filter, which does not allow the call). A failure is
    /// logged: the device works either way.
    pub(crate) fn apply(self) {
        let policy = match self {
            DeviceSched::Batch => libc::SCHED_BATCH,
            DeviceSched::Normal => return,
        };
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is the calling thread; `param` is a valid
        // sched_param for the duration of the call.
        if unsafe { libc::sched_setscheduler(0, policy, &param) } != 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), policy = %self, "device thread keeps the normal scheduling policy");
        }
    }
}
