//! An epoll instance's ready list, in the order Linux keeps it.
//!
//! Linux queues a descriptor at the tail of the list when it becomes ready
//! and reports from the head; a level-triggered descriptor that is still
//! ready after being reported goes back to the tail, so one busy descriptor
//! cannot starve the others. Programs see that order: Redis, for one, runs
//! the commands of two connections in the order their data arrived.
//!
//! Readiness here is found by asking the descriptors (there are no wakeup
//! callbacks), so the list is brought up to date at each look: descriptors
//! no longer ready leave it, and those that became ready since the last
//! look join the tail in the order they became ready (a stamp their object
//! keeps; equal stamps go in descriptor order).

use alloc::collections::{BTreeSet, VecDeque};
use alloc::vec::Vec;

#[derive(Default)]
pub struct ReadyList {
    order: VecDeque<u64>,
    members: BTreeSet<u64>,
}

impl ReadyList {
    pub fn new() -> ReadyList {
        ReadyList::default()
    }

    /// Bring the list up to date with `ready`: every descriptor ready now,
    /// with the stamp of when it became ready.
    pub fn update(&mut self, ready: &[(u64, u64)]) {
        let now: BTreeSet<u64> = ready.iter().map(|&(fd, _)| fd).collect();
        self.order.retain(|fd| now.contains(fd));
        self.members.retain(|fd| now.contains(fd));
        let mut joining: Vec<(u64, u64)> =
            ready.iter().filter(|(fd, _)| !self.members.contains(fd)).map(|&(fd, since)| (since, fd)).collect();
        joining.sort_unstable();
        joining.dedup();
        for (_, fd) in joining {
            self.members.insert(fd);
            self.order.push_back(fd);
        }
    }

    /// Take up to `max` descriptors off the head, in order. Put back the
    /// ones that stay queued with [`ReadyList::requeue`].
    pub fn take(&mut self, max: usize) -> Vec<u64> {
        let n = max.min(self.order.len());
        let taken: Vec<u64> = self.order.drain(..n).collect();
        for fd in &taken {
            self.members.remove(fd);
        }
        taken
    }

    /// `fd` was reported and stays queued (level-triggered): at the tail.
    pub fn requeue(&mut self, fd: u64) {
        if self.members.insert(fd) {
            self.order.push_back(fd);
        }
    }

    /// `fd` left the interest list.
    pub fn remove(&mut self, fd: u64) {
        if self.members.remove(&fd) {
            self.order.retain(|&f| f != fd);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    #[test]
    fn descriptors_join_in_the_order_they_became_ready_not_by_number() {
        let mut l = ReadyList::new();
        // fd 9 became ready first (stamp 1), then fd 5 (stamp 2).
        l.update(&[(5, 2), (9, 1)]);
        assert_eq!(l.take(8), vec![9, 5]);
    }

    #[test]
    fn equal_stamps_go_in_descriptor_order() {
        let mut l = ReadyList::new();
        l.update(&[(7, 0), (3, 0), (5, 0)]);
        assert_eq!(l.take(8), vec![3, 5, 7]);
    }

    #[test]
    fn a_later_arrival_joins_behind_those_already_queued() {
        let mut l = ReadyList::new();
        l.update(&[(9, 4)]);
        // fd 3's stamp is older, but 9 was already queued when 3 was seen.
        l.update(&[(9, 4), (3, 1)]);
        assert_eq!(l.take(8), vec![9, 3]);
    }

    #[test]
    fn a_reported_descriptor_still_ready_goes_to_the_tail() {
        let mut l = ReadyList::new();
        l.update(&[(4, 1), (5, 2), (6, 3)]);
        let first = l.take(1);
        assert_eq!(first, vec![4]);
        l.requeue(4);
        l.update(&[(4, 1), (5, 2), (6, 3)]);
        // 4 is busy but waits its turn behind 5 and 6.
        assert_eq!(l.take(2), vec![5, 6]);
        l.requeue(5);
        l.requeue(6);
        assert_eq!(l.take(8), vec![4, 5, 6]);
    }

    #[test]
    fn descriptors_no_longer_ready_leave_and_rejoin_at_the_tail() {
        let mut l = ReadyList::new();
        l.update(&[(1, 1), (2, 2)]);
        l.update(&[(2, 2)]);
        assert!(!l.is_empty());
        l.update(&[(2, 2), (1, 5)]);
        assert_eq!(l.take(8), vec![2, 1]);
        l.update(&[]);
        assert!(l.is_empty());
    }

    #[test]
    fn removed_descriptors_are_not_reported() {
        let mut l = ReadyList::new();
        l.update(&[(1, 1), (2, 2), (3, 3)]);
        l.remove(2);
        l.remove(42);
        assert_eq!(l.take(8), vec![1, 3]);
    }

    #[test]
    fn requeueing_twice_queues_once() {
        let mut l = ReadyList::new();
        l.requeue(1);
        l.requeue(1);
        assert_eq!(l.take(8), vec![1]);
        assert!(l.is_empty());
    }
}
