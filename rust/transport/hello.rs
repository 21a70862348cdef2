//! The hello's contents (the client's hello, the worker's challenge and proof, the chain description
//! every stage relays upstream) and the head-side chain check (docs/protocol.md "Hello").

use crate::error::{QkError, Result};

/// What one stage tells the head about itself. Relayed upstream stage by stage, so the head sees
/// the whole chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageDesc {
    /// Who this stage is, for error messages (e.g. "gpu2:9100").
    pub name: String,
    /// Random per process start: a changed boot id on reconnect means the stage restarted and lost
    /// its snapshots.
    pub boot_id: u64,
    /// The stage runs layers [layer_first, layer_end) of n_layer.
    pub layer_first: u32,
    pub layer_end: u32,
    pub n_layer: u32,
    pub n_embd: u32,
    pub slots: u32,
    /// Context positions per slot.
    pub ctx: u32,
    /// Snapshot capacity: entries, and bytes of state those entries may hold.
    pub snap_entries: u32,
    pub snap_bytes: u64,
    /// Hash of the model file's header and tensor table, as a string supplied by the engine.
    pub fingerprint: String,
    /// The GPU adapter the stage runs on.
    pub adapter: String,
}

/// HELLO, client → worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientHello {
    pub nonce: [u8; 32],
    /// The connecting side (head or upstream stage), for logs and "busy" messages.
    pub name: String,
    /// Replace a live head session instead of being refused as busy.
    pub takeover: bool,
    /// The client has a shared secret and will send a proof.
    pub has_secret: bool,
}

/// CHALLENGE, worker → client: the worker's nonce for the client to prove against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Challenge {
    pub nonce: [u8; 32],
    pub has_secret: bool,
}

/// PROOF, client → worker: HMAC over the transcript, or none without a secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Proof {
    pub proof: Option<[u8; 32]>,
}

/// HELLO_REPLY, worker → client: this worker's description first, then every stage after it, and the
/// worker's own proof when it has a secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HelloReply {
    pub chain: Vec<StageDesc>,
    pub proof: Option<[u8; 32]>,
}

fn refuse(msg: String) -> QkError {
    QkError::Transport(format!("chain refused: {msg}"))
}

/// The head-side check of a chain (docs/protocol.md "Chain check"): `downstream` must continue `own` contiguously to
/// n_layer, with the same model (fingerprint, n_layer, n_embd) and slots/ctx covering `own`'s. Also
/// usable by a worker on the part of the chain below it. The first failure, in chain order, is
/// returned with the stage and the numbers named.
pub fn check_chain(own: &StageDesc, downstream: &[StageDesc]) -> Result<()> {
    if own.layer_first >= own.layer_end || own.layer_end > own.n_layer {
        return Err(refuse(format!(
            "'{}' has layer range [{}, {}) of {} layers, which is empty or out of range",
            own.name, own.layer_first, own.layer_end, own.n_layer
        )));
    }
    let mut end = own.layer_end;
    let mut previous = own.name.as_str();
    for (i, stage) in downstream.iter().enumerate() {
        let who = format!("stage {} '{}'", i + 2, stage.name);
        if stage.fingerprint != own.fingerprint {
            return Err(refuse(format!(
                "{who} serves model fingerprint {}, '{}' serves {}",
                stage.fingerprint, own.name, own.fingerprint
            )));
        }
        if stage.n_layer != own.n_layer {
            return Err(refuse(format!(
                "{who} has n_layer {}, '{}' has {}",
                stage.n_layer, own.name, own.n_layer
            )));
        }
        if stage.n_embd != own.n_embd {
            return Err(refuse(format!(
                "{who} has n_embd {}, '{}' has {}",
                stage.n_embd, own.name, own.n_embd
            )));
        }
        if stage.layer_first > end {
            return Err(refuse(format!(
                "{who} starts at layer {}, leaving layers [{end}, {}) unserved after '{previous}'",
                stage.layer_first, stage.layer_first
            )));
        }
        if stage.layer_first < end {
            return Err(refuse(format!(
                "{who} starts at layer {}, overlapping '{previous}' which ends at {end}",
                stage.layer_first
            )));
        }
        if stage.layer_end <= stage.layer_first || stage.layer_end > stage.n_layer {
            return Err(refuse(format!(
                "{who} has layer range [{}, {}) of {} layers, which is empty or out of range",
                stage.layer_first, stage.layer_end, stage.n_layer
            )));
        }
        if stage.slots < own.slots {
            return Err(refuse(format!(
                "{who} has {} slots, fewer than the {} of '{}'",
                stage.slots, own.slots, own.name
            )));
        }
        if stage.ctx < own.ctx {
            return Err(refuse(format!(
                "{who} has ctx {} per slot, less than the {} of '{}'",
                stage.ctx, own.ctx, own.name
            )));
        }
        end = stage.layer_end;
        previous = &stage.name;
    }
    if end != own.n_layer {
        return Err(refuse(format!(
            "the chain ends at layer {end} (after '{previous}'), the model has {} layers",
            own.n_layer
        )));
    }
    Ok(())
}

/// Snapshot entries usable across the whole chain: the smallest capacity of any stage.
pub fn chain_snapshot_entries(own: &StageDesc, downstream: &[StageDesc]) -> u32 {
    downstream
        .iter()
        .map(|s| s.snap_entries)
        .fold(own.snap_entries, u32::min)
}
