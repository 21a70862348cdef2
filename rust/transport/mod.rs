//! qkp, the stage transport (spec/qkp.md): a pure frame codec (`frame`, `messages`), the hello's
//! contents and chain check (`hello`), its shared-secret proofs (`auth`), and the blocking TCP
//! connection layer a worker's serve loop and the head's split driver build on (`conn`).

pub mod auth;
pub mod conn;
pub mod frame;
pub mod hello;
pub mod messages;

pub use conn::{ClientConfig, Conn, ServerConfig, ServerHandshake, SessionGate, SessionTicket, Timeouts};
pub use frame::{ErrorCode, Limits, Op, VERSION};
pub use hello::{Challenge, ClientHello, HelloReply, Proof, StageDesc, check_chain};
pub use messages::{
    Ack, ErrorMsg, HiddenRows, Message, Rows, Run, RunOut, RunReply, Step, StepEntry, StepOut, StepReply,
    decode, encode,
};
