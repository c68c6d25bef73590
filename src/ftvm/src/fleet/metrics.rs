//! `ftvm agent --metrics-listen ADDR`: the fleet as this agent last read it,
//! in Prometheus's format. Every agent serves the whole fleet (any one is
//! enough to scrape), and whether it leads.

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use ftvm_fleet::placement::Fleet;
use ftvm_fleet::Role;

type Labels = Vec<(&'static str, String)>;

#[derive(Clone, Default)]
pub struct FleetMetrics {
    leader: Gauge,
    vm_protected: Family<Labels, Gauge>,
    vm_placed: Family<Labels, Gauge>,
    vm_unplaced: Family<Labels, Gauge>,
    host_memory: Family<Labels, Gauge>,
    host_vms: Family<Labels, Gauge>,
}

impl FleetMetrics {
    pub fn registry(&self) -> Registry {
        let mut r = Registry::with_prefix("ftvm_fleet");
        r.register("leader", "1 while this agent decides the fleet's placement", self.leader.clone());
        r.register(
            "vm_protected",
            "1 while the VM's primary reports a backup in step (a VSMR VM: its three replicas run, its leader has a secondary in step)",
            self.vm_protected.clone(),
        );
        r.register(
            "vm_placed",
            "1 for the host each part of the VM (primary, backup; VSMR: replica, witness) is placed on",
            self.vm_placed.clone(),
        );
        r.register("vm_unplaced", "1 while the VM lacks a host or a backup (the reason is in ftvm vm list)", self.vm_unplaced.clone());
        r.register("host_memory_mib", "Guest memory the host offers the fleet, in MiB", self.host_memory.clone());
        r.register(
            "host_vms",
            "VM processes placed on the host, by role (primary, backup, replica: a VSMR replica)",
            self.host_vms.clone(),
        );
        r
    }

    /// Show `fleet` as read now.
    pub fn update(&self, fleet: &Fleet, me: &str) {
        self.leader.set(i64::from(fleet.leader.as_deref() == Some(me)));
        for family in [&self.vm_protected, &self.vm_placed, &self.vm_unplaced, &self.host_memory, &self.host_vms] {
            family.clear();
        }
        for vm in fleet.vms.keys() {
            let p = fleet.placements.get(vm).map(|(p, _)| p.clone()).unwrap_or_default();
            let protected = if p.replicas.is_empty() {
                p.primary.as_ref().is_some_and(|h| fleet.reports(vm, h, Role::Primary, true))
            } else {
                fleet.protected(vm)
            };
            self.vm_protected.get_or_create(&vec![("vm", vm.clone())]).set(i64::from(protected));
            self.vm_unplaced.get_or_create(&vec![("vm", vm.clone())]).set(i64::from(fleet.unplaced.contains_key(vm)));
            for (part, host) in [("primary", &p.primary), ("backup", &p.backup)] {
                if let Some(host) = host {
                    self.vm_placed.get_or_create(&vec![("vm", vm.clone()), ("part", part.into()), ("host", host.clone())]).set(1);
                }
            }
            for slot in p.replicas.iter().chain(p.replacing.as_ref().map(|r| &r.slot)) {
                let part = if slot.witness { "witness" } else { "replica" };
                self.vm_placed.get_or_create(&vec![("vm", vm.clone()), ("part", part.into()), ("host", slot.host.clone())]).set(1);
            }
        }
        for (name, host) in &fleet.hosts {
            self.host_memory.get_or_create(&vec![("host", name.clone())]).set(host.memory_mib as i64);
            for (part, primary) in [("primary", true), ("backup", false)] {
                let n =
                    fleet.placements.values().filter(|(p, _)| if primary { &p.primary } else { &p.backup }.as_ref() == Some(name)).count();
                self.host_vms.get_or_create(&vec![("host", name.clone()), ("role", part.into())]).set(n as i64);
            }
            let replicas = fleet.placements.values().filter(|(p, _)| p.slot_on(name).is_some()).count();
            self.host_vms.get_or_create(&vec![("host", name.clone()), ("role", "replica".into())]).set(replicas as i64);
        }
    }
}
