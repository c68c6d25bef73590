//! An authenticated (and optionally encrypted) channel on top of another
//! transport (`--secret-file`, `--encrypt`).
//!
//! Connect: a challenge-response handshake in both directions with fresh
//! random nonces, before the primary's Hello is processed:
//!
//! ```text
//!  P → B  AuthHello     nonce_p [32] | flags u8 (bit 0: encrypt)
//!  B → P  AuthChallenge nonce_b [32]
//!  P → B  AuthProof     BLAKE3-keyed(K, "primary proof" | T)     T = "ftvm auth v1" | nonce_p | nonce_b | flags
//!  B → P  AuthAccept    BLAKE3-keyed(K, "backup proof" | T)      (or Refuse "authentication failed")
//! ```
//!
//! `K` is the long-term key derived from the secret file (`Secret`); each
//! side proves it holds `K` only for nonces the other side just chose, and
//! the backup proves nothing to a peer that has not proved first. Session
//! keys, one per direction, are derived from `K` and `T`, so they are fresh
//! for every connection and bound to the `flags` both sides saw.
//!
//! Afterwards every frame is preceded by a Seal frame: `seq u64 | tag`.
//! `seq` counts the frames of one direction from 0; the receiver accepts
//! only the next one, so a replayed, reordered, dropped or reflected frame
//! is refused. Without encryption the frame itself is unchanged and `tag`
//! is BLAKE3-keyed(K_dir, seq | kind u16 | length u64 | payload) (32
//! bytes); with encryption the frame's payload is its ChaCha20-Poly1305
//! ciphertext under K_dir with nonce `seq u64 | 0u32` and the header fields
//! `seq | kind | length` as associated data, its checksum recomputed, and
//! `tag` is the Poly1305 tag (16 bytes).

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chacha20poly1305::aead::AeadInPlace;
use chacha20poly1305::{ChaCha20Poly1305, KeyInit};

use ftvm_vmm::sync::Lock;

use super::{Secret, Transport};
use crate::error::ReplicationError;
use crate::liveness::{self, Pulse};
use crate::protocol::{self, Kind, ProtocolError};

const NONCE: usize = 32;
const PROOF: usize = 32;
const FLAG_ENCRYPT: u8 = 1;
const TRANSCRIPT_LABEL: &[u8] = b"ftvm auth v1";
const PRIMARY_PROOF: &[u8] = b"primary proof";
const BACKUP_PROOF: &[u8] = b"backup proof";
const PRIMARY_TO_BACKUP: &str = "ftvm replication 2025 session key primary to backup";
const BACKUP_TO_PRIMARY: &str = "ftvm replication 2025 session key backup to primary";
const HEARTBEAT_PRIMARY_TO_BACKUP: &str = "ftvm replication 2025 heartbeat key primary to backup";
const HEARTBEAT_BACKUP_TO_PRIMARY: &str = "ftvm replication 2025 heartbeat key backup to primary";
/// Handshake frames are tiny.
const HANDSHAKE_FRAME_LIMIT: u64 = 256;
/// How long the primary waits for each handshake answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// Frames up to this size travel in one write with their seal.
const COALESCE: usize = 64 << 10;

/// What an authenticated channel needs: the shared secret and whether to encrypt.
#[derive(Clone, Debug)]
pub struct Auth {
    pub secret: Secret,
    /// The primary: encrypt the channel. The backup: refuse a primary that does not.
    pub encrypt: bool,
}

/// How frames are protected in one direction.
enum Protection {
    /// BLAKE3 keyed hash, frames in clear.
    Mac([u8; 32]),
    /// ChaCha20-Poly1305.
    Encrypt(Box<ChaCha20Poly1305>),
}

impl Protection {
    fn new(key: [u8; 32], encrypt: bool) -> Protection {
        if encrypt {
            Protection::Encrypt(Box::new(ChaCha20Poly1305::new(&key.into())))
        } else {
            Protection::Mac(key)
        }
    }

    fn tag_len(&self) -> usize {
        match self {
            Protection::Mac(_) => 32,
            Protection::Encrypt(_) => 16,
        }
    }
}

/// The header fields a tag covers besides the payload.
fn associated(seq: u64, kind: u16, len: usize) -> [u8; 18] {
    let mut a = [0u8; 18];
    a[..8].copy_from_slice(&seq.to_le_bytes());
    a[8..10].copy_from_slice(&kind.to_le_bytes());
    a[10..].copy_from_slice(&(len as u64).to_le_bytes());
    a
}

fn mac(key: &[u8; 32], seq: u64, kind: u16, payload: &[u8]) -> blake3::Hash {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(&associated(seq, kind, payload.len()));
    h.update(payload);
    h.finalize()
}

fn aead_nonce(seq: u64) -> chacha20poly1305::Nonce {
    let mut n = [0u8; 12];
    n[..8].copy_from_slice(&seq.to_le_bytes());
    n.into()
}

/// The sending half: the next sequence number and a scratch buffer.
struct Sealer {
    protection: Protection,
    seq: u64,
    scratch: Vec<u8>,
}

/// The receiving half: the next sequence number expected, and a seal whose
/// frame has not arrived yet (a timeout between the two).
struct Opener {
    protection: Protection,
    seq: u64,
    pending: Option<(u64, Vec<u8>)>,
    seal: Vec<u8>,
}

/// A transport whose frames are authenticated (and encrypted with
/// `--encrypt`); handles made by `try_clone` share the sequence numbers.
pub struct AuthTransport<T> {
    inner: T,
    tx: Arc<Mutex<Sealer>>,
    rx: Arc<Mutex<Opener>>,
    /// This end's keys for the connection's heartbeats (`liveness`); set
    /// by the handshake.
    heartbeat: Option<liveness::Keys>,
}

/// Session keys of one connection, per direction: for its frames and for
/// its heartbeats.
struct Keys {
    primary_to_backup: [u8; 32],
    backup_to_primary: [u8; 32],
    heartbeat_primary_to_backup: [u8; 32],
    heartbeat_backup_to_primary: [u8; 32],
}

struct Transcript([u8; TRANSCRIPT_LABEL.len() + 2 * NONCE + 1]);

impl Transcript {
    fn new(nonce_p: &[u8; NONCE], nonce_b: &[u8; NONCE], flags: u8) -> Transcript {
        let mut t = [0u8; TRANSCRIPT_LABEL.len() + 2 * NONCE + 1];
        let (label, rest) = t.split_at_mut(TRANSCRIPT_LABEL.len());
        label.copy_from_slice(TRANSCRIPT_LABEL);
        rest[..NONCE].copy_from_slice(nonce_p);
        rest[NONCE..2 * NONCE].copy_from_slice(nonce_b);
        rest[2 * NONCE] = flags;
        Transcript(t)
    }

    fn proof(&self, secret: &Secret, role: &[u8]) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(secret.key());
        h.update(role);
        h.update(&self.0);
        h.finalize()
    }

    fn keys(&self, secret: &Secret) -> Keys {
        let derive = |context| {
            let mut h = blake3::Hasher::new_derive_key(context);
            h.update(secret.key());
            h.update(&self.0);
            *h.finalize().as_bytes()
        };
        Keys {
            primary_to_backup: derive(PRIMARY_TO_BACKUP),
            backup_to_primary: derive(BACKUP_TO_PRIMARY),
            heartbeat_primary_to_backup: derive(HEARTBEAT_PRIMARY_TO_BACKUP),
            heartbeat_backup_to_primary: derive(HEARTBEAT_BACKUP_TO_PRIMARY),
        }
    }
}

fn nonce() -> Result<[u8; NONCE], ReplicationError> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|e| ReplicationError::Auth(format!("no random numbers for a nonce: {e}")))?;
    Ok(n)
}

fn fixed<const N: usize>(payload: &[u8], what: &str) -> Result<[u8; N], ProtocolError> {
    payload.try_into().map_err(|_| ProtocolError::Corrupt(format!("{what} of {} bytes", payload.len())))
}

fn send(link: &mut dyn Transport, frame: &[u8]) -> Result<(), ReplicationError> {
    link.send(frame).map_err(ReplicationError::Send)
}

/// Tell a peer why it is refused (best effort: it may not be listening).
pub fn refuse(link: &mut dyn Transport, reason: &str) {
    let _ = link.send(&protocol::message(Kind::Refuse, &reason.to_string()));
}

impl<T: Transport> AuthTransport<T> {
    /// The primary's side: authenticate to the backup on `inner` and make
    /// it authenticate to us.
    pub fn initiate(mut inner: T, auth: &Auth) -> Result<AuthTransport<T>, ReplicationError> {
        let flags = if auth.encrypt { FLAG_ENCRYPT } else { 0 };
        let nonce_p = nonce()?;
        let mut hello = nonce_p.to_vec();
        hello.push(flags);
        send(&mut inner, &protocol::frame(Kind::AuthHello, &hello))?;
        inner.set_recv_timeout(Some(ANSWER_TIMEOUT)).map_err(ReplicationError::Send)?;
        let mut buf = Vec::new();
        let nonce_b: [u8; NONCE] = match inner.recv(HANDSHAKE_FRAME_LIMIT, &mut buf)? {
            Kind::AuthChallenge => fixed(&buf, "challenge")?,
            Kind::Refuse => return Err(ReplicationError::Refused(protocol::decode(&buf)?)),
            other => return Err(ProtocolError::Corrupt(format!("expected the backup's challenge, got {other:?}")).into()),
        };
        let transcript = Transcript::new(&nonce_p, &nonce_b, flags);
        send(&mut inner, &protocol::frame(Kind::AuthProof, transcript.proof(&auth.secret, PRIMARY_PROOF).as_bytes()))?;
        let proof: [u8; PROOF] = match inner.recv(HANDSHAKE_FRAME_LIMIT, &mut buf)? {
            Kind::AuthAccept => fixed(&buf, "backup proof")?,
            Kind::Refuse => return Err(ReplicationError::Refused(protocol::decode(&buf)?)),
            other => return Err(ProtocolError::Corrupt(format!("expected the backup's proof, got {other:?}")).into()),
        };
        // Constant-time comparison (blake3::Hash's PartialEq).
        if transcript.proof(&auth.secret, BACKUP_PROOF) != blake3::Hash::from(proof) {
            let peer = inner.peer();
            inner.shutdown();
            return Err(ReplicationError::Auth(format!("{peer} could not prove it holds the secret; it is not this primary's backup")));
        }
        inner.set_recv_timeout(None).map_err(ReplicationError::Send)?;
        let keys = transcript.keys(&auth.secret);
        let heartbeat = liveness::Keys { send: keys.heartbeat_primary_to_backup, recv: keys.heartbeat_backup_to_primary };
        Ok(AuthTransport::new(inner, keys.primary_to_backup, keys.backup_to_primary, auth.encrypt).with_heartbeat(heartbeat))
    }

    /// The backup's side, once the first frame (`kind`, `payload`) arrived
    /// on `inner`: make the peer authenticate, then authenticate to it.
    /// A peer that fails is told why (when it spoke the handshake) and the
    /// error says what happened.
    pub fn respond(mut inner: T, kind: Kind, payload: &[u8], auth: &Auth) -> Result<AuthTransport<T>, ReplicationError> {
        match kind {
            Kind::AuthHello => {}
            Kind::Hello => {
                refuse(&mut inner, "authentication required: this backup has a --secret-file; start the primary with the same one");
                return Err(ReplicationError::Auth("the peer did not authenticate (no --secret-file)".into()));
            }
            other => return Err(ProtocolError::Corrupt(format!("expected a handshake, got {other:?}")).into()),
        }
        if payload.len() != NONCE + 1 || payload[NONCE] & !FLAG_ENCRYPT != 0 {
            return Err(ProtocolError::Corrupt(format!("malformed authentication hello of {} bytes", payload.len())).into());
        }
        let nonce_p: [u8; NONCE] = payload[..NONCE].try_into().expect("nonce length");
        let flags = payload[NONCE];
        let encrypt = flags & FLAG_ENCRYPT != 0;
        if auth.encrypt && !encrypt {
            refuse(&mut inner, "this backup requires an encrypted channel: start the primary with --encrypt");
            return Err(ReplicationError::Auth("the peer did not ask for encryption, which this backup requires".into()));
        }
        let nonce_b = nonce()?;
        send(&mut inner, &protocol::frame(Kind::AuthChallenge, &nonce_b))?;
        let mut buf = Vec::new();
        let proof: [u8; PROOF] = match inner.recv(HANDSHAKE_FRAME_LIMIT, &mut buf)? {
            Kind::AuthProof => fixed(&buf, "primary proof")?,
            other => return Err(ProtocolError::Corrupt(format!("expected the primary's proof, got {other:?}")).into()),
        };
        let transcript = Transcript::new(&nonce_p, &nonce_b, flags);
        if transcript.proof(&auth.secret, PRIMARY_PROOF) != blake3::Hash::from(proof) {
            refuse(&mut inner, "authentication failed");
            return Err(ReplicationError::Auth("wrong secret (the peer's proof does not match)".into()));
        }
        send(&mut inner, &protocol::frame(Kind::AuthAccept, transcript.proof(&auth.secret, BACKUP_PROOF).as_bytes()))?;
        let keys = transcript.keys(&auth.secret);
        let heartbeat = liveness::Keys { send: keys.heartbeat_backup_to_primary, recv: keys.heartbeat_primary_to_backup };
        Ok(AuthTransport::new(inner, keys.backup_to_primary, keys.primary_to_backup, encrypt).with_heartbeat(heartbeat))
    }

    fn new(inner: T, send_key: [u8; 32], recv_key: [u8; 32], encrypt: bool) -> AuthTransport<T> {
        let tx = Sealer { protection: Protection::new(send_key, encrypt), seq: 0, scratch: Vec::new() };
        let rx = Opener { protection: Protection::new(recv_key, encrypt), seq: 0, pending: None, seal: Vec::new() };
        AuthTransport { inner, tx: Arc::new(Mutex::new(tx)), rx: Arc::new(Mutex::new(rx)), heartbeat: None }
    }

    fn with_heartbeat(self, heartbeat: liveness::Keys) -> AuthTransport<T> {
        AuthTransport { heartbeat: Some(heartbeat), ..self }
    }
}

/// Where one piece of a sealed batch is: bytes in the sealer's scratch
/// buffer, or one of the caller's frames as it is.
enum Piece {
    Scratch(std::ops::Range<usize>),
    Frame(usize),
}

impl Sealer {
    /// Seal `frame` (the batch's `i`-th) onto `pieces`: its seal, and the
    /// frame itself (copied after the seal when small, encrypted in the
    /// scratch buffer, or referred to when large).
    fn seal(&mut self, i: usize, frame: &[u8], pieces: &mut Vec<Piece>) -> io::Result<()> {
        let Some((kind, payload)) = protocol::split_frame(frame) else {
            // Not a whole frame (the test faults cut frames short): sent as
            // it is, unsealed, so the other side refuses it.
            pieces.push(Piece::Frame(i));
            return Ok(());
        };
        if matches!(self.protection, Protection::Encrypt(_)) && !protocol::checksum_ok(frame) {
            // A damaged frame (test faults) stays damaged: sent as it is.
            pieces.push(Piece::Frame(i));
            return Ok(());
        }
        let seq = self.seq;
        self.seq = seq.checked_add(1).ok_or_else(|| io::Error::other("sequence numbers exhausted"))?;
        let start = self.scratch.len();
        match &self.protection {
            Protection::Mac(key) => {
                let tag = mac(key, seq, kind, payload);
                push_seal(&mut self.scratch, seq, tag.as_bytes());
                if frame.len() <= COALESCE {
                    self.scratch.extend_from_slice(frame);
                    pieces.push(Piece::Scratch(start..self.scratch.len()));
                } else {
                    pieces.push(Piece::Scratch(start..self.scratch.len()));
                    pieces.push(Piece::Frame(i));
                }
            }
            Protection::Encrypt(cipher) => {
                let seal_len = seal_frame_len(16);
                self.scratch.resize(start + seal_len, 0);
                self.scratch.extend_from_slice(frame);
                let body = start + seal_len + protocol::PAYLOAD_OFFSET;
                let tag = cipher
                    .encrypt_in_place_detached(
                        &aead_nonce(seq),
                        &associated(seq, kind, payload.len()),
                        &mut self.scratch[body..body + payload.len()],
                    )
                    .map_err(|_| io::Error::other("encryption failed"))?;
                protocol::refresh_checksum(&mut self.scratch[start + seal_len..]);
                let mut seal = Vec::with_capacity(seal_len);
                push_seal(&mut seal, seq, &tag);
                self.scratch[start..start + seal_len].copy_from_slice(&seal);
                pieces.push(Piece::Scratch(start..self.scratch.len()));
            }
        }
        Ok(())
    }
}

impl<T: Transport> Transport for AuthTransport<T> {
    fn send(&mut self, frame: &[u8]) -> io::Result<()> {
        self.send_batch(&[frame])
    }

    /// Every frame sealed on its own (its sequence number and tag), the
    /// whole batch handed to the inner transport at once: small frames
    /// with their seals as one buffer.
    fn send_batch(&mut self, frames: &[&[u8]]) -> io::Result<()> {
        let mut guard = self.tx.locked();
        let tx = &mut *guard;
        tx.scratch.clear();
        let mut pieces = Vec::with_capacity(frames.len() * 2);
        for (i, frame) in frames.iter().enumerate() {
            tx.seal(i, frame, &mut pieces)?;
        }
        // Neighbouring scratch pieces are one slice.
        let mut out: Vec<&[u8]> = Vec::with_capacity(pieces.len());
        let mut run: Option<std::ops::Range<usize>> = None;
        for piece in pieces {
            match piece {
                Piece::Scratch(r) => match &mut run {
                    Some(open) if open.end == r.start => open.end = r.end,
                    _ => {
                        if let Some(open) = run.replace(r) {
                            out.push(&tx.scratch[open]);
                        }
                    }
                },
                Piece::Frame(i) => {
                    if let Some(open) = run.take() {
                        out.push(&tx.scratch[open]);
                    }
                    out.push(frames[i]);
                }
            }
        }
        if let Some(open) = run {
            out.push(&tx.scratch[open]);
        }
        self.inner.send_batch(&out)
    }

    fn recv(&mut self, limit: u64, buf: &mut Vec<u8>) -> Result<Kind, ProtocolError> {
        let mut guard = self.rx.locked();
        let rx = &mut *guard;
        let tag_len = rx.protection.tag_len();
        let (seq, tag) = match rx.pending.take() {
            Some(sealed) => sealed,
            None => {
                // Room for a whole frame of the caller's limit, so an unsealed
                // frame is named as such (not as one over the seal's size).
                match self.inner.recv(limit.max(8 + tag_len as u64), &mut rx.seal)? {
                    Kind::Seal => {}
                    other => return Err(ProtocolError::Unauthenticated(format!("{other:?} frame without a seal"))),
                }
                if rx.seal.len() != 8 + tag_len {
                    return Err(ProtocolError::Unauthenticated(format!("seal of {} bytes", rx.seal.len())));
                }
                let seq = u64::from_le_bytes(rx.seal[..8].try_into().expect("8 bytes"));
                (seq, rx.seal[8..].to_vec())
            }
        };
        if seq != rx.seq {
            return Err(ProtocolError::Unauthenticated(format!(
                "frame number {seq} where {} was due (replayed, reordered or dropped)",
                rx.seq
            )));
        }
        let kind = match self.inner.recv(limit, buf) {
            Ok(Kind::Seal) => return Err(ProtocolError::Unauthenticated("a seal sealing a seal".into())),
            Ok(kind) => kind,
            Err(ProtocolError::Timeout) => {
                rx.pending = Some((seq, tag));
                return Err(ProtocolError::Timeout);
            }
            Err(e) => return Err(e),
        };
        let authentic = match &rx.protection {
            Protection::Mac(key) => {
                let tag: [u8; 32] = tag.as_slice().try_into().expect("checked length");
                // Constant-time comparison (blake3::Hash's PartialEq).
                mac(key, seq, kind as u16, buf) == blake3::Hash::from(tag)
            }
            Protection::Encrypt(cipher) => cipher
                .decrypt_in_place_detached(&aead_nonce(seq), &associated(seq, kind as u16, buf.len()), buf, tag.as_slice().into())
                .is_ok(),
        };
        if !authentic {
            return Err(ProtocolError::Unauthenticated(format!("{kind:?} frame number {seq} failed authentication")));
        }
        rx.seq += 1;
        Ok(kind)
    }

    fn set_recv_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        self.inner.set_recv_timeout(timeout)
    }

    fn try_clone(&self) -> io::Result<Box<dyn Transport>> {
        Ok(Box::new(AuthTransport {
            inner: self.inner.try_clone()?,
            tx: self.tx.clone(),
            rx: self.rx.clone(),
            heartbeat: self.heartbeat.clone(),
        }))
    }

    fn shutdown(&self) {
        self.inner.shutdown();
    }

    /// (Each frame then takes its seal too.)
    fn room(&self) -> Option<usize> {
        self.inner.room()
    }

    fn busy(&self) -> Option<Duration> {
        self.inner.busy()
    }

    fn peer(&self) -> String {
        self.inner.peer()
    }

    fn addrs(&self) -> Option<(SocketAddr, SocketAddr)> {
        self.inner.addrs()
    }

    fn observe(&mut self, pulse: Arc<Pulse>) {
        self.inner.observe(pulse)
    }

    fn heartbeat_keys(&self) -> Option<liveness::Keys> {
        self.heartbeat.clone()
    }
}

fn seal_frame_len(tag_len: usize) -> usize {
    protocol::PAYLOAD_OFFSET + 8 + tag_len + 4
}

fn push_seal(buf: &mut Vec<u8>, seq: u64, tag: &[u8]) {
    let mut payload = [0u8; 8 + 32];
    payload[..8].copy_from_slice(&seq.to_le_bytes());
    payload[8..8 + tag.len()].copy_from_slice(tag);
    buf.extend_from_slice(&protocol::frame(Kind::Seal, &payload[..8 + tag.len()]));
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};

    use super::*;
    use crate::pipeline::transport::{accept, connect, TcpTransport};
    use crate::protocol::HANDSHAKE_LIMIT;

    fn auth(secret: &[u8], encrypt: bool) -> Auth {
        Auth { secret: Secret::from_bytes(secret), encrypt }
    }

    /// The backup's side of a connection: its first frame, then `respond`.
    fn respond(mut link: TcpTransport, auth: &Auth) -> Result<AuthTransport<TcpTransport>, ReplicationError> {
        let mut buf = Vec::new();
        let kind = link.recv(HANDSHAKE_LIMIT, &mut buf)?;
        AuthTransport::respond(link, kind, &buf, auth)
    }

    /// A backup on a loopback port running `respond` with `auth`; its
    /// result arrives on the returned channel.
    fn backup(auth: Auth) -> (String, std::thread::JoinHandle<Result<AuthTransport<TcpTransport>, ReplicationError>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        (addr, std::thread::spawn(move || respond(accept(&listener).unwrap(), &auth)))
    }

    #[test]
    fn both_sides_authenticate_and_frames_cross_both_ways() {
        for encrypt in [false, true] {
            let (addr, b) = backup(auth(b"s3cret", false));
            let mut p = AuthTransport::initiate(connect(&addr, Duration::from_secs(5)).unwrap(), &auth(b"s3cret", encrypt)).unwrap();
            let mut b = b.join().unwrap().unwrap();
            let mut buf = Vec::new();
            let big = vec![0x5au8; 3 * COALESCE];
            for round in 0..3u64 {
                p.send(&protocol::frame(Kind::Checkpoint, &big)).unwrap();
                p.send(&protocol::message(Kind::Bye, &7i32)).unwrap();
                assert_eq!(b.recv(1 << 20, &mut buf).unwrap(), Kind::Checkpoint);
                assert_eq!(buf, big);
                assert_eq!(b.recv(100, &mut buf).unwrap(), Kind::Bye);
                assert_eq!(protocol::decode::<i32>(&buf).unwrap(), 7);
                b.send(&protocol::ack(round)).unwrap();
                // A clone continues the sequence of the handle it came from.
                let mut acks = p.try_clone().unwrap();
                assert_eq!(acks.recv(100, &mut buf).unwrap(), Kind::Ack);
                assert_eq!(protocol::read_ack(&buf).unwrap(), round);
            }
        }
    }

    #[test]
    fn heartbeat_keys_are_per_connection_and_per_direction() {
        let mut seen = Vec::new();
        for _ in 0..2 {
            let (addr, b) = backup(auth(b"s3cret", false));
            let p = AuthTransport::initiate(connect(&addr, Duration::from_secs(5)).unwrap(), &auth(b"s3cret", false)).unwrap();
            let b = b.join().unwrap().unwrap();
            let (pk, bk) = (p.heartbeat_keys().unwrap(), b.heartbeat_keys().unwrap());
            assert_eq!((pk.send, pk.recv), (bk.recv, bk.send), "each side opens what the other tags");
            assert_ne!(pk.send, pk.recv, "one key per direction");
            assert!(p.try_clone().unwrap().heartbeat_keys().is_some_and(|k| k.send == pk.send));
            seen.push(pk.send);
        }
        assert_ne!(seen[0], seen[1], "fresh keys for every connection");
    }

    #[test]
    fn a_wrong_secret_fails_on_both_sides() {
        let (addr, b) = backup(auth(b"right", false));
        let p = AuthTransport::initiate(connect(&addr, Duration::from_secs(5)).unwrap(), &auth(b"wrong", false));
        assert!(matches!(&p, Err(ReplicationError::Refused(r)) if r == "authentication failed"), "{:?}", p.err());
        let b = b.join().unwrap();
        assert!(matches!(&b, Err(ReplicationError::Auth(r)) if r.contains("wrong secret")), "{:?}", b.err());
    }

    #[test]
    fn an_unauthenticated_primary_is_told_to_authenticate() {
        let (addr, b) = backup(auth(b"s", false));
        let mut p = connect(&addr, Duration::from_secs(5)).unwrap();
        p.send(&protocol::message(Kind::Hello, &())).unwrap();
        let mut buf = Vec::new();
        assert_eq!(p.recv(1000, &mut buf).unwrap(), Kind::Refuse);
        assert!(protocol::decode::<String>(&buf).unwrap().starts_with("authentication required"));
        assert!(matches!(b.join().unwrap(), Err(ReplicationError::Auth(_))));
    }

    #[test]
    fn an_encrypting_backup_refuses_a_primary_in_clear() {
        let (addr, b) = backup(auth(b"s", true));
        let p = AuthTransport::initiate(connect(&addr, Duration::from_secs(5)).unwrap(), &auth(b"s", false));
        assert!(matches!(&p, Err(ReplicationError::Refused(r)) if r.contains("--encrypt")), "{:?}", p.err());
        assert!(b.join().unwrap().is_err());
    }

    /// Forward frames from `from` to `to`, flipping a bit in the payload of
    /// the first frame of kind `tamper` (and fixing its checksum, as an
    /// attacker on the path would).
    fn relay(mut from: TcpStream, mut to: TcpStream, tamper: Kind) {
        let mut buf = Vec::new();
        let mut done = false;
        while let Ok(kind) = protocol::read_frame(&mut from, HANDSHAKE_LIMIT, &mut buf) {
            if kind == tamper && !done {
                buf[3] ^= 0x10;
                done = true;
            }
            if to.write_all(&protocol::frame(kind, &buf)).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Both);
    }

    #[test]
    fn a_tampered_nonce_fails_the_handshake() {
        for tamper in [Kind::AuthHello, Kind::AuthChallenge] {
            let (backup_addr, b) = backup(auth(b"k", false));
            let front = TcpListener::bind("127.0.0.1:0").unwrap();
            let front_addr = front.local_addr().unwrap().to_string();
            let mitm = std::thread::spawn(move || {
                let (p, _) = front.accept().unwrap();
                let b = TcpStream::connect(&backup_addr).unwrap();
                let (p2, b2) = (p.try_clone().unwrap(), b.try_clone().unwrap());
                let up = std::thread::spawn(move || relay(p, b, tamper));
                relay(b2, p2, tamper);
                up.join().unwrap();
            });
            let p = AuthTransport::initiate(connect(&front_addr, Duration::from_secs(5)).unwrap(), &auth(b"k", false));
            assert!(matches!(&p, Err(ReplicationError::Refused(r)) if r == "authentication failed"), "{tamper:?}: {:?}", p.err());
            assert!(matches!(b.join().unwrap(), Err(ReplicationError::Auth(_))), "{tamper:?}");
            drop(p);
            mitm.join().unwrap();
        }
    }

    /// An in-memory transport: every send is recorded, recv reads `input`.
    #[derive(Default)]
    struct Mem {
        sent: Vec<Vec<u8>>,
        input: io::Cursor<Vec<u8>>,
    }

    impl Transport for Mem {
        fn send(&mut self, frame: &[u8]) -> io::Result<()> {
            self.sent.push(frame.to_vec());
            Ok(())
        }
        fn recv(&mut self, limit: u64, buf: &mut Vec<u8>) -> Result<Kind, ProtocolError> {
            protocol::read_frame(&mut self.input, limit, buf)
        }
        fn set_recv_timeout(&mut self, _: Option<Duration>) -> io::Result<()> {
            Ok(())
        }
        fn try_clone(&self) -> io::Result<Box<dyn Transport>> {
            Err(io::Error::other("not cloneable"))
        }
        fn shutdown(&self) {}
        fn peer(&self) -> String {
            "memory".into()
        }
    }

    /// What a primary with session keys (`k1` out, `k2` in) sends for `frames`.
    fn sealed(frames: &[Vec<u8>], encrypt: bool) -> Vec<Vec<u8>> {
        let mut p = AuthTransport::new(Mem::default(), [1; 32], [2; 32], encrypt);
        for f in frames {
            p.send(f).unwrap();
        }
        p.inner.sent
    }

    /// What a backup with the matching keys makes of `wire`.
    fn opened(wire: &[u8], encrypt: bool) -> Vec<Result<(Kind, Vec<u8>), String>> {
        let mem = Mem { input: io::Cursor::new(wire.to_vec()), ..Mem::default() };
        let mut b = AuthTransport::new(mem, [2; 32], [1; 32], encrypt);
        let mut out = Vec::new();
        let mut buf = Vec::new();
        loop {
            match b.recv(1 << 20, &mut buf) {
                Err(ProtocolError::Closed) => return out,
                Ok(kind) => out.push(Ok((kind, buf.clone()))),
                Err(e) => {
                    out.push(Err(e.to_string()));
                    return out;
                }
            }
        }
    }

    fn acks(epochs: &[u64]) -> Vec<Vec<u8>> {
        epochs.iter().map(|&e| protocol::ack(e)).collect()
    }

    #[test]
    fn the_stream_opens_in_order() {
        for encrypt in [false, true] {
            let marker = 0x1122_3344_5566_7788;
            let wire = sealed(&acks(&[1, marker, 3]), encrypt).concat();
            let got = opened(&wire, encrypt);
            let epochs: Vec<u64> = got.iter().map(|r| protocol::read_ack(&r.as_ref().unwrap().1).unwrap()).collect();
            assert_eq!(epochs, [1, marker, 3]);
            // Encrypted frames do not carry their payload in clear.
            let clear = wire.windows(8).any(|w| w == marker.to_le_bytes());
            assert_eq!(clear, !encrypt);
        }
    }

    fn refused(wire: &[u8], encrypt: bool, good_before: usize, what: &str) {
        let got = opened(wire, encrypt);
        assert_eq!(got.len(), good_before + 1, "{what}: {got:?}");
        assert!(got[..good_before].iter().all(Result::is_ok), "{what}: {got:?}");
        let err = got[good_before].as_ref().unwrap_err();
        assert!(err.starts_with("unauthenticated replication data"), "{what}: {err}");
    }

    #[test]
    fn replayed_reordered_dropped_modified_and_forged_frames_are_refused() {
        for encrypt in [false, true] {
            let s = sealed(&acks(&[1, 2, 3]), encrypt);
            refused(&[s[0].clone(), s[0].clone()].concat(), encrypt, 1, "replayed");
            refused(&[s[0].clone(), s[2].clone(), s[1].clone()].concat(), encrypt, 1, "reordered");
            refused(&[s[1].clone(), s[2].clone()].concat(), encrypt, 0, "dropped");
            // A payload byte changed, with the frame's checksum made right again.
            let mut modified = s[1].clone();
            let data = seal_frame_len(Protection::new([0; 32], encrypt).tag_len());
            modified[data + protocol::PAYLOAD_OFFSET] ^= 1;
            protocol::refresh_checksum(&mut modified[data..]);
            refused(&[s[0].clone(), modified].concat(), encrypt, 1, "modified");
            // A forged acknowledgement without a seal, or with another frame's seal.
            refused(&[s[0].clone(), protocol::ack(9)].concat(), encrypt, 1, "unsealed");
            let mut forged = s[1][..data].to_vec();
            forged.extend_from_slice(&protocol::ack(9));
            refused(&[s[0].clone(), forged].concat(), encrypt, 1, "forged under a real seal");
            // A backup's own frame (sequence number 0, like the next one it
            // expects) reflected back to it.
            let mut b = AuthTransport::new(Mem::default(), [2; 32], [1; 32], encrypt);
            b.send(&protocol::ack(1)).unwrap();
            b.inner.input = io::Cursor::new(b.inner.sent.concat());
            assert!(matches!(b.recv(100, &mut Vec::new()), Err(ProtocolError::Unauthenticated(_))));
        }
    }

    #[test]
    fn a_batch_is_sealed_frame_by_frame_and_handed_on_in_few_pieces() {
        for encrypt in [false, true] {
            let big = protocol::frame(Kind::Checkpoint, &vec![3u8; 2 * COALESCE]);
            let frames = [protocol::ack(1), big.clone(), protocol::ack(2), protocol::ack(3)];
            let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
            let mut p = AuthTransport::new(Mem::default(), [1; 32], [2; 32], encrypt);
            p.send_batch(&refs).unwrap();
            // In clear: the small frames with their seals and the big
            // frame's seal, the big frame itself, the last two small ones.
            // Encrypted: everything is in the scratch buffer.
            assert_eq!(p.inner.sent.len(), if encrypt { 1 } else { 3 });
            let got = opened(&p.inner.sent.concat(), encrypt);
            let got: Vec<(Kind, Vec<u8>)> = got.into_iter().map(Result::unwrap).collect();
            let want: Vec<(Kind, Vec<u8>)> = frames
                .iter()
                .map(|f| {
                    let mut payload = Vec::new();
                    (protocol::read_frame(&mut &f[..], 1 << 20, &mut payload).unwrap(), payload)
                })
                .collect();
            assert_eq!(got, want);
            // The sequence goes on after a batch.
            p.send(&protocol::ack(4)).unwrap();
            assert_eq!(opened(&p.inner.sent.concat(), encrypt).len(), 5);
        }
    }

    #[test]
    fn large_frames_and_damaged_frames() {
        for encrypt in [false, true] {
            let big = protocol::frame(Kind::Checkpoint, &vec![7u8; 2 * COALESCE]);
            let got = opened(&sealed(std::slice::from_ref(&big), encrypt).concat(), encrypt);
            assert_eq!(got[0].as_ref().unwrap().1, &big[protocol::PAYLOAD_OFFSET..big.len() - 4]);
            // A frame cut short or flipped before sealing (the test faults)
            // is refused by the backup, never applied.
            let cut = sealed(&[big[..big.len() / 2].to_vec()], encrypt).concat();
            assert!(opened(&cut, encrypt)[0].is_err());
            let mut flipped = big.clone();
            flipped[1000] ^= 8;
            let got = opened(&sealed(&[flipped], encrypt).concat(), encrypt);
            assert!(got[0].as_ref().is_err_and(|e| e.contains("checksum mismatch") || e.contains("without a seal")), "{got:?}");
        }
    }
}
