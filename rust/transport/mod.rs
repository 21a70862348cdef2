//! qkp, the stage transport (docs/protocol.md): a pure frame codec (`frame`, `messages`), the hello's
//! contents and chain check (`hello`), its shared-secret proofs (`auth`), the blocking TCP
//! connection layer (`conn`), and what runs on it: a worker's serve loop (`worker`), the head's link
//! (`head`) and pipeline (`split_head`), both around a `Stage` (`stage`; the native engine's is
//! `engine_stage`).

pub mod auth;
pub mod conn;
pub mod engine_stage;
pub mod frame;
pub mod head;
pub mod hello;
pub mod messages;
pub mod split_head;
pub mod stage;
pub mod worker;

pub use conn::{
    ClientConfig, Conn, ServerConfig, ServerHandshake, SessionGate, SessionTicket, Takeover, Timeouts,
};
pub use engine_stage::EngineStage;
pub use frame::{ErrorCode, Limits, Op, VERSION};
pub use head::{HeadConfig, HeadLink, RunResult, StepResult};
pub use hello::{Challenge, ClientHello, HelloReply, Proof, StageDesc, check_chain};
pub use messages::{
    Ack, ErrorMsg, HiddenRows, Message, Rows, Run, RunOut, RunReply, Step, StepEntry, StepOut, StepReply,
    decode, encode,
};
pub use split_head::{ChainStatus, Pending, SplitConfig, SplitHead, StepTotals};
pub use stage::{Stage, StageInfo};
pub use worker::{WorkerConfig, WorkerControl, serve_worker};
