//! qkp, the stage transport (docs/protocol.md): a pure frame codec (`frame`, `messages`), the hello's
//! contents and chain check (`hello`), its shared-secret proofs (`auth`), and the blocking TCP
//! connection layer a worker's serve loop and the head's split driver build on (`conn`).

pub mod auth;
pub mod conn;
pub mod frame;
pub mod head;
pub mod hello;
pub mod messages;
pub mod stage;
pub mod worker;

pub use conn::{ClientConfig, Conn, ServerConfig, ServerHandshake, SessionGate, SessionTicket, Timeouts};
pub use frame::{ErrorCode, Limits, Op, VERSION};
pub use head::{HeadConfig, HeadLink, RunResult, StepResult};
pub use hello::{Challenge, ClientHello, HelloReply, Proof, StageDesc, check_chain};
pub use messages::{
    Ack, ErrorMsg, HiddenRows, Message, Rows, Run, RunOut, RunReply, Step, StepEntry, StepOut, StepReply,
    decode, encode,
};
pub use stage::{Stage, StageInfo};
pub use worker::{WorkerConfig, WorkerControl, serve_worker};
