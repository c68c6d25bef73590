//! `--link-batch on`: the raft messages of one consensus round, gathered
//! per peer, so that each peer's sender thread is handed them together
//! (one channel send, one wake-up) instead of once per message; it then
//! writes them in one `writev` (`mesh`). A round yields messages in up to
//! three places (raft-rs's ready, its persisted messages, the light
//! ready's); each still goes as its own frame, in the order raft made it.

/// Frames for each peer, in the order they were queued; peers in the
/// order of their first frame.
#[derive(Debug, Default)]
pub struct Outbox {
    peers: Vec<(u64, Vec<Vec<u8>>)>,
}

impl Outbox {
    /// Queue `frame` for peer `to`, after those queued for it before.
    pub fn push(&mut self, to: u64, frame: Vec<u8>) {
        // Two or three peers: a scan beats a map.
        match self.peers.iter_mut().find(|(id, _)| *id == to) {
            Some((_, frames)) => frames.push(frame),
            None => self.peers.push((to, vec![frame])),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    /// Each peer's frames, as one batch per peer; the outbox is empty after.
    pub fn drain(&mut self) -> impl Iterator<Item = (u64, Vec<Vec<u8>>)> + '_ {
        self.peers.drain(..)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_gives_each_peer_one_batch_in_the_order_queued() {
        let mut out = Outbox::default();
        assert!(out.is_empty());
        out.push(2, vec![1]);
        out.push(3, vec![2]);
        out.push(2, vec![3]);
        out.push(2, vec![4]);
        out.push(3, vec![5]);
        let batches: Vec<_> = out.drain().collect();
        assert_eq!(batches, vec![(2, vec![vec![1], vec![3], vec![4]]), (3, vec![vec![2], vec![5]])]);
        assert!(out.is_empty(), "drained");
        out.push(3, vec![6]);
        assert_eq!(out.drain().collect::<Vec<_>>(), vec![(3, vec![vec![6]])], "a new round starts empty");
    }
}
