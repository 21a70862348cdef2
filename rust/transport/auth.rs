//! The hello's shared-secret proofs: each side answers the other's nonce with an HMAC-SHA256 over
//! both nonces and the hello contents, labelled by role so one side's proof never passes for the
//! other's. The secret itself never crosses the wire (docs/protocol.md "Shared-secret proof"). Also the randomness the
//! hello needs (nonces, boot ids).

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::error::{QkError, Result};
use crate::transport::hello::{Challenge, ClientHello, HelloReply, StageDesc};
use crate::transport::messages::{Message, encode};

type HmacSha256 = Hmac<Sha256>;

/// Which side a proof speaks for. The label is the first thing the MAC covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Client,
    Worker,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Client => b"qkp client proof\0",
            Role::Worker => b"qkp worker proof\0",
        }
    }
}

/// Fresh random bytes from the OS.
pub fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut out = [0u8; N];
    getrandom::fill(&mut out)
        .map_err(|e| QkError::Transport(format!("no OS randomness for a nonce: {e}")))?;
    Ok(out)
}

/// A nonce for one hello.
pub fn nonce() -> Result<[u8; 32]> {
    random_bytes::<32>()
}

/// A boot id: random per process start, so a restarted stage is told apart from a live one.
pub fn boot_id() -> Result<u64> {
    Ok(u64::from_le_bytes(random_bytes::<8>()?))
}

/// What the client's proof covers: its hello and the worker's challenge, as encoded frames (frames
/// are self-delimiting and carry the version, so the concatenation is unambiguous).
pub fn client_transcript(hello: &ClientHello, challenge: &Challenge) -> Result<Vec<u8>> {
    let mut t = encode(&Message::Hello(hello.clone()))?;
    t.extend(encode(&Message::Challenge(challenge.clone()))?);
    Ok(t)
}

/// What the worker's proof covers: the client's transcript plus the chain it answers with.
pub fn worker_transcript(hello: &ClientHello, challenge: &Challenge, chain: &[StageDesc]) -> Result<Vec<u8>> {
    let mut t = client_transcript(hello, challenge)?;
    t.extend(encode(&Message::HelloReply(HelloReply {
        chain: chain.to_vec(),
        proof: None,
    }))?);
    Ok(t)
}

fn mac(secret: &[u8], role: Role, transcript: &[u8]) -> Result<HmacSha256> {
    let mut mac = HmacSha256::new_from_slice(secret)
        .map_err(|e| QkError::Transport(format!("shared secret unusable as an HMAC key: {e}")))?;
    mac.update(role.label());
    mac.update(transcript);
    Ok(mac)
}

/// The proof `role` sends for `transcript`.
pub fn prove(secret: &[u8], role: Role, transcript: &[u8]) -> Result<[u8; 32]> {
    let mut out = [0u8; 32];
    out.copy_from_slice(&mac(secret, role, transcript)?.finalize().into_bytes());
    Ok(out)
}

/// Whether `proof` is `role`'s proof of `transcript` (compared in constant time).
pub fn verify(secret: &[u8], role: Role, transcript: &[u8], proof: &[u8; 32]) -> Result<bool> {
    Ok(mac(secret, role, transcript)?.verify_slice(proof).is_ok())
}

/// Plain HMAC-SHA256, exposed so tests can check the primitive against a published vector.
pub fn hmac_sha256(key: &[u8], message: &[u8]) -> Result<[u8; 32]> {
    let mut mac = HmacSha256::new_from_slice(key)
        .map_err(|e| QkError::Transport(format!("key unusable as an HMAC key: {e}")))?;
    mac.update(message);
    let mut out = [0u8; 32];
    out.copy_from_slice(&mac.finalize().into_bytes());
    Ok(out)
}
