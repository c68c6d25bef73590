//! After a takeover, the switches between the VM's clients and its new
//! host still send its frames to the old one: a few broadcasts from the
//! VM's MAC address teach them where it now is. Every role that resumes a
//! VM elsewhere (a backup, a consensus replica) sends them.

use ftvm_vmm::Vm;

/// Tell the L2 network that the guest's MAC now lives here: reverse-ARP
/// broadcasts need no IP address, and every switch learns the new port.
pub fn announce(vm: &Vm) {
    let (Some(mac), Some(tap)) = (vm.config().devices.net.as_ref().map(|n| n.mac), vm.devices().tap_sink()) else { return };
    let mut frame = vec![0u8; ftvm_vmm::devices::virtio::net::VNET_HDR_LEN];
    frame.extend_from_slice(&[0xff; 6]);
    frame.extend_from_slice(&mac);
    frame.extend_from_slice(&[0x80, 0x35]); // RARP
    frame.extend_from_slice(&[0, 1, 0x08, 0x00, 6, 4, 0, 3]); // Ethernet/IPv4, reverse request
    frame.extend_from_slice(&mac);
    frame.extend_from_slice(&[0; 4]);
    frame.extend_from_slice(&mac);
    frame.extend_from_slice(&[0; 4]);
    frame.resize(ftvm_vmm::devices::virtio::net::VNET_HDR_LEN + 60, 0);
    for _ in 0..3 {
        tap.send(&frame);
    }
}
