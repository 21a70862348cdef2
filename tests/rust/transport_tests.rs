//! qkp transport tests: codec round trips and every bound (pure, no sockets), version handling, the
//! HMAC proofs, the chain check, and loopback-socket hellos against a test-double worker.

use std::net::{TcpListener, TcpStream};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use qk::transport::auth::{self, Role};
use qk::transport::frame::{
    self, ErrorCode, FLAG_SECRET, FLAG_TAKEOVER, HEADER_LEN, Header, Limits, MAX_MESSAGE, MAX_NAME, MAX_ROWS,
    MAX_STAGES, MAX_TOPK, MAX_WIDTH, Op, VERSION,
};
use qk::transport::hello::chain_snapshot_entries;
use qk::transport::{
    Ack, Challenge, ClientConfig, ClientHello, Conn, ErrorMsg, HelloReply, HiddenRows, Message, Proof, Rows,
    Run, RunOut, RunReply, ServerConfig, ServerHandshake, SessionGate, StageDesc, Step, StepEntry, StepOut,
    StepReply, Timeouts, check_chain, decode, encode,
};

fn stage(name: &str, first: u32, end: u32) -> StageDesc {
    StageDesc {
        name: name.to_string(),
        boot_id: 0x1234_5678_9abc_def0 ^ first as u64,
        layer_first: first,
        layer_end: end,
        n_layer: 48,
        n_embd: 2048,
        slots: 4,
        ctx: 8192,
        snap_entries: 8,
        snap_bytes: 3 << 30,
        fingerprint: "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08".to_string(),
        adapter: "NVIDIA H200 (Vulkan)".to_string(),
    }
}

fn hidden(n: usize, width: u32) -> HiddenRows {
    HiddenRows {
        width,
        data: (0..n * width as usize).map(|i| i as f32 * 0.25 - 3.0).collect(),
    }
}

/// One example of every message, and of every variant of the ones with variants.
fn every_message() -> Vec<Message> {
    vec![
        Message::Hello(ClientHello {
            nonce: [7; 32],
            name: "head".into(),
            takeover: true,
            has_secret: true,
        }),
        Message::Hello(ClientHello {
            nonce: [0; 32],
            name: String::new(),
            takeover: false,
            has_secret: false,
        }),
        Message::Challenge(Challenge {
            nonce: [9; 32],
            has_secret: true,
        }),
        Message::Proof(Proof { proof: Some([3; 32]) }),
        Message::Proof(Proof { proof: None }),
        Message::HelloReply(HelloReply {
            chain: vec![stage("w1", 20, 30), stage("w2", 30, 48)],
            proof: Some([1; 32]),
        }),
        Message::HelloReply(HelloReply {
            chain: vec![stage("ünïcode", 0, 48)],
            proof: None,
        }),
        Message::Run(Run {
            slot: 1,
            base: 0,
            topk: 0,
            rows: Rows::Tokens(vec![1, 2, 3, 151935]),
        }),
        Message::Run(Run {
            slot: 3,
            base: 64,
            topk: 256,
            rows: Rows::Hidden(hidden(3, 16)),
        }),
        Message::RunReply(RunReply {
            slot: 1,
            base: 64,
            out: RunOut::Ids {
                ids: vec![5, 6],
                topk: vec![(5, 3.5), (9, -1.25)],
            },
        }),
        Message::RunReply(RunReply {
            slot: 0,
            base: 0,
            out: RunOut::Ids {
                ids: vec![5],
                topk: vec![],
            },
        }),
        Message::RunReply(RunReply {
            slot: 2,
            base: 7,
            out: RunOut::Hidden(hidden(2, 8)),
        }),
        Message::Step(Step {
            topk: 2,
            entries: vec![StepEntry { slot: 0, base: 10 }, StepEntry { slot: 3, base: 99 }],
            rows: Rows::Tokens(vec![11, 12]),
        }),
        Message::Step(Step {
            topk: 0,
            entries: vec![StepEntry { slot: 1, base: 5 }],
            rows: Rows::Hidden(hidden(1, 4)),
        }),
        Message::StepReply(StepReply {
            entries: vec![StepEntry { slot: 0, base: 10 }, StepEntry { slot: 3, base: 99 }],
            out: StepOut::Ids {
                ids: vec![1, 2],
                topk: vec![vec![(1, 0.5), (4, 0.25)], vec![(2, 1.0), (8, -0.5)]],
            },
        }),
        Message::StepReply(StepReply {
            entries: vec![StepEntry { slot: 2, base: 1 }],
            out: StepOut::Ids {
                ids: vec![42],
                topk: vec![vec![]],
            },
        }),
        Message::StepReply(StepReply {
            entries: vec![StepEntry { slot: 2, base: 1 }, StepEntry { slot: 1, base: 2 }],
            out: StepOut::Hidden(hidden(2, 4)),
        }),
        Message::Save { slot: 1, idx: 7 },
        Message::Load { slot: 2, idx: 7 },
        Message::Drop { idx: 7 },
        Message::Ack(Ack {
            of: Op::Save,
            slot: 1,
            idx: 7,
        }),
        Message::Ack(Ack {
            of: Op::Drop,
            slot: 0,
            idx: 3,
        }),
        Message::Error(ErrorMsg::new(
            ErrorCode::Stage,
            "w2",
            "slot 3: base 10 is past the slot's 8 positions",
        )),
        Message::Close,
        Message::Ping { seq: 41 },
        Message::Pong { seq: 41 },
    ]
}

#[test]
fn every_message_round_trips_and_encodes_canonically() {
    let all = every_message();
    let ops: std::collections::HashSet<Op> = all.iter().map(Message::op).collect();
    assert_eq!(ops.len(), Op::ALL.len(), "the sample must cover every op");
    for msg in all {
        let bytes = encode(&msg).unwrap();
        let back = decode(&bytes).unwrap();
        assert_eq!(back, msg);
        assert_eq!(
            encode(&back).unwrap(),
            bytes,
            "{:?} re-encodes differently",
            msg.op()
        );
        let h = frame::decode_header(&bytes, &Limits::default()).unwrap();
        assert_eq!(
            h.len as usize,
            bytes.len() - HEADER_LEN,
            "{:?}: header length",
            msg.op()
        );
    }
}

#[test]
fn header_layout_matches_the_documented_offsets() {
    let bytes = encode(&Message::Run(Run {
        slot: 3,
        base: 128,
        topk: 5,
        rows: Rows::Tokens(vec![0xAABBCCDD]),
    }))
    .unwrap();
    assert_eq!(&bytes[0..4], b"qkpf");
    assert_eq!(bytes[4..8], VERSION.to_le_bytes());
    assert_eq!(bytes[8..10], (Op::Run as u16).to_le_bytes());
    assert_eq!(bytes[10..12], [0, 0]); // flags
    assert_eq!(bytes[12..16], 3u32.to_le_bytes()); // slot
    assert_eq!(bytes[16..20], 1u32.to_le_bytes()); // n
    assert_eq!(bytes[20..24], 128u32.to_le_bytes()); // base
    assert_eq!(bytes[24..28], 5u32.to_le_bytes()); // arg = top-k
    assert_eq!(bytes[28..32], 0u32.to_le_bytes()); // width 0: token ids
    assert_eq!(bytes[32..36], 4u32.to_le_bytes()); // payload bytes
    assert_eq!(bytes[36..], [0xDD, 0xCC, 0xBB, 0xAA]);
    // Hidden rows are little-endian f32, row-major.
    let bytes = encode(&Message::Run(Run {
        slot: 0,
        base: 0,
        topk: 0,
        rows: Rows::Hidden(HiddenRows {
            width: 2,
            data: vec![1.0, -2.0],
        }),
    }))
    .unwrap();
    assert_eq!(bytes[28..32], 2u32.to_le_bytes());
    assert_eq!(bytes[36..40], 1.0f32.to_le_bytes());
    assert_eq!(bytes[40..44], (-2.0f32).to_le_bytes());
}

/// A header, encoded with the given fields, followed by `payload`: bad frames built by hand.
fn raw(h: Header, payload: &[u8]) -> Vec<u8> {
    let mut out = frame::encode_header(&h).to_vec();
    out.extend_from_slice(payload);
    out
}

fn refused(bytes: &[u8], expect: &str) {
    match decode(bytes) {
        Ok(m) => panic!("decoded {m:?}, expected a refusal containing {expect:?}"),
        Err(e) => assert!(e.to_string().contains(expect), "{e} does not contain {expect:?}"),
    }
}

fn run_header(n: u32, width: u32, topk: u32) -> Header {
    let len = if width == 0 { n * 4 } else { n * width * 4 };
    Header {
        op: Op::Run,
        flags: 0,
        slot: 0,
        n,
        base: 0,
        arg: topk,
        width,
        len,
    }
}

#[test]
fn header_bounds_are_checked_before_any_payload() {
    // Rows: 1..=MAX_ROWS. The payload is not even present: the header alone is refused.
    refused(&raw(run_header(0, 0, 0), &[]), "n = 0");
    refused(&frame::encode_header(&run_header(MAX_ROWS + 1, 0, 0)), "n = 4097");
    refused(
        &frame::encode_header(&run_header(1, MAX_WIDTH + 1, 0)),
        "row width 16385",
    );
    refused(
        &frame::encode_header(&run_header(1, 0, MAX_TOPK + 1)),
        "top-k 257",
    );
    // The maximum frame is allowed by the header check (256 MiB of hidden rows).
    let max = run_header(MAX_ROWS, MAX_WIDTH, MAX_TOPK);
    assert_eq!(
        frame::decode_header(&frame::encode_header(&max), &Limits::default()).unwrap(),
        max
    );
    // A connection that knows n_embd refuses wider rows before allocating.
    let tight = Limits {
        max_rows: 64,
        max_width: 2048,
    };
    let e = frame::decode_header(&frame::encode_header(&run_header(1, 4096, 0)), &tight).unwrap_err();
    assert!(e.to_string().contains("row width 4096 exceeds 2048"), "{e}");
    let e = frame::decode_header(&frame::encode_header(&run_header(65, 0, 0)), &tight).unwrap_err();
    assert!(e.to_string().contains("n = 65, allowed 1..=64"), "{e}");
    // Payload length must be exactly what n/width/top-k imply.
    let mut h = run_header(2, 0, 0);
    h.len = 12;
    refused(&raw(h, &[0; 12]), "payload is 12 bytes, the header implies 8");
    let mut h = Header::new(Op::RunReply);
    (h.n, h.arg, h.len) = (2, 3, 8);
    refused(&raw(h, &[0; 8]), "the header implies 32");
    let mut h = Header::new(Op::Ping);
    h.len = 1;
    refused(&raw(h, &[0]), "payload is 1 bytes, the header implies 0");
    // base + n must not wrap around.
    let mut h = run_header(2, 0, 0);
    h.base = u32::MAX;
    refused(&raw(h, &[0; 8]), "overflows");
    // Stage count of a hello reply: 1..=MAX_STAGES.
    let mut h = Header::new(Op::HelloReply);
    h.n = MAX_STAGES + 1;
    refused(&frame::encode_header(&h), "65 stages");
    h.n = 0;
    refused(&frame::encode_header(&h), "0 stages");
    // Unknown op, unknown flags, a used-must-be-zero field, an unknown error code.
    let mut bytes = encode(&Message::Close).unwrap();
    bytes[8..10].copy_from_slice(&99u16.to_le_bytes());
    refused(&bytes, "unknown op 99");
    let mut h = Header::new(Op::Run);
    (h.n, h.len, h.flags) = (1, 4, FLAG_TAKEOVER);
    refused(&raw(h, &[0; 4]), "unknown flags");
    let mut h = Header::new(Op::Close);
    h.slot = 1;
    refused(&raw(h, &[]), "field slot must be 0");
    let mut h = Header::new(Op::Drop);
    h.slot = 2;
    refused(&raw(h, &[]), "field slot must be 0");
    let mut h = Header::new(Op::Error);
    (h.arg, h.len) = (77, 4);
    refused(&raw(h, &[0; 4]), "unknown error code 77");
    // Hidden replies carry no top-k.
    let mut h = Header::new(Op::RunReply);
    (h.n, h.width, h.arg, h.len) = (1, 2, 1, 8);
    refused(&raw(h, &[0; 8]), "field arg must be 0");
    // Not our magic; short header.
    let mut bytes = encode(&Message::Close).unwrap();
    bytes[0] = b'X';
    refused(&bytes, "magic");
    refused(&bytes[..10], "header is 10 bytes");
}

#[test]
fn payload_contents_are_checked() {
    // A string longer than its cap, declared inside a payload the header allows.
    let mut payload = vec![0u8; 32];
    payload.extend_from_slice(&((MAX_NAME + 1) as u16).to_le_bytes());
    let mut h = Header::new(Op::Hello);
    h.len = payload.len() as u32;
    refused(&raw(h, &payload), "client name is 129 bytes, the cap is 128");
    // A string that claims more bytes than remain.
    let mut payload = vec![0u8; 32];
    payload.extend_from_slice(&10u16.to_le_bytes());
    payload.extend_from_slice(b"abc");
    h.len = payload.len() as u32;
    refused(&raw(h, &payload), "payload ends");
    // Not UTF-8.
    let mut payload = vec![0u8; 32];
    payload.extend_from_slice(&2u16.to_le_bytes());
    payload.extend_from_slice(&[0xff, 0xfe]);
    h.len = payload.len() as u32;
    refused(&raw(h, &payload), "not UTF-8");
    // Bytes left over after the strings.
    let mut payload = vec![0u8; 32];
    payload.extend_from_slice(&0u16.to_le_bytes());
    payload.push(1);
    h.len = payload.len() as u32;
    refused(&raw(h, &payload), "1 bytes left over");
    // An ack of something that is not save/load/drop.
    let mut h = Header::new(Op::Ack);
    h.len = 4;
    refused(&raw(h, &(Op::Run as u32).to_le_bytes()), "acknowledged op 16");
    // Header and buffer disagree: a truncated frame.
    let bytes = encode(&Message::Run(Run {
        slot: 0,
        base: 0,
        topk: 0,
        rows: Rows::Tokens(vec![1, 2]),
    }))
    .unwrap();
    refused(
        &bytes[..bytes.len() - 1],
        "7 payload bytes, the header announces 8",
    );
    let mut longer = bytes.clone();
    longer.push(0);
    refused(&longer, "9 payload bytes");
}

#[test]
fn every_prefix_and_every_single_byte_change_decodes_or_errors_without_panicking() {
    for msg in every_message() {
        let bytes = encode(&msg).unwrap();
        for cut in 0..bytes.len() {
            assert!(
                decode(&bytes[..cut]).is_err(),
                "{:?} cut at {cut} decoded",
                msg.op()
            );
        }
        for at in 0..bytes.len().min(200) {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut mutated = bytes.clone();
                mutated[at] ^= flip;
                // Whatever decodes is canonical: it re-encodes to exactly the same bytes.
                if let Ok(m) = decode(&mutated) {
                    assert_eq!(
                        encode(&m).unwrap(),
                        mutated,
                        "{:?}: byte {at} ^ {flip:#x}",
                        msg.op()
                    );
                }
            }
        }
    }
}

#[test]
fn encode_refuses_what_decode_would_refuse() {
    let too_long = "x".repeat(MAX_NAME + 1);
    let cases: Vec<(Message, &str)> = vec![
        (
            Message::Run(Run {
                slot: 0,
                base: 0,
                topk: 0,
                rows: Rows::Tokens(vec![]),
            }),
            "n = 0",
        ),
        (
            Message::Run(Run {
                slot: 0,
                base: 0,
                topk: 0,
                rows: Rows::Tokens(vec![0; 4097]),
            }),
            "n = 4097",
        ),
        (
            Message::Run(Run {
                slot: 0,
                base: 0,
                topk: 257,
                rows: Rows::Tokens(vec![0]),
            }),
            "top-k 257",
        ),
        (
            Message::Run(Run {
                slot: 0,
                base: 0,
                topk: 0,
                rows: Rows::Hidden(HiddenRows {
                    width: 3,
                    data: vec![0.0; 4],
                }),
            }),
            "not whole rows",
        ),
        (
            Message::Run(Run {
                slot: 0,
                base: 0,
                topk: 0,
                rows: Rows::Hidden(HiddenRows {
                    width: 0,
                    data: vec![],
                }),
            }),
            "not whole rows",
        ),
        (
            Message::Step(Step {
                topk: 0,
                entries: vec![StepEntry { slot: 0, base: 0 }],
                rows: Rows::Tokens(vec![1, 2]),
            }),
            "1 entries but 2 rows",
        ),
        (
            Message::StepReply(StepReply {
                entries: vec![StepEntry { slot: 0, base: 0 }; 2],
                out: StepOut::Ids {
                    ids: vec![1, 2],
                    topk: vec![vec![(1, 0.0)], vec![]],
                },
            }),
            "different lengths",
        ),
        (
            Message::RunReply(RunReply {
                slot: 0,
                base: 0,
                out: RunOut::Ids {
                    ids: vec![1],
                    topk: vec![(0, 0.0); 257],
                },
            }),
            "top-k 257",
        ),
        (
            Message::Hello(ClientHello {
                nonce: [0; 32],
                name: too_long.clone(),
                takeover: false,
                has_secret: false,
            }),
            "cap is 128",
        ),
        (
            Message::HelloReply(HelloReply {
                chain: vec![],
                proof: None,
            }),
            "0 stages",
        ),
        (
            Message::HelloReply(HelloReply {
                chain: vec![stage("w", 0, 1); 65],
                proof: None,
            }),
            "65 stages",
        ),
        (
            Message::HelloReply(HelloReply {
                chain: vec![StageDesc {
                    fingerprint: too_long,
                    ..stage("w", 0, 1)
                }],
                proof: None,
            }),
            "model fingerprint is 129 bytes",
        ),
        (
            Message::Ack(Ack {
                of: Op::Run,
                slot: 0,
                idx: 0,
            }),
            "an ack of run",
        ),
        (
            Message::Error(ErrorMsg {
                code: ErrorCode::Stage,
                stage: "s".into(),
                message: "m".repeat(MAX_MESSAGE + 1),
            }),
            "cap is 4096",
        ),
    ];
    for (msg, expect) in cases {
        match encode(&msg) {
            Ok(_) => panic!("encoded {:?}, expected {expect:?}", msg.op()),
            Err(e) => assert!(e.to_string().contains(expect), "{e} does not contain {expect:?}"),
        }
    }
    // ErrorMsg::new cuts over-long text at a character boundary so an error can always be sent.
    let e = ErrorMsg::new(ErrorCode::Stage, &"é".repeat(100), "ü".repeat(3000));
    assert_eq!((e.stage.len(), e.message.len()), (128, 4096));
    assert!(encode(&Message::Error(e)).is_ok());
}

#[test]
fn largest_frames_round_trip() {
    let n = MAX_ROWS as usize;
    let tokens = Message::Run(Run {
        slot: 0,
        base: 0,
        topk: MAX_TOPK,
        rows: Rows::Tokens((0..n as u32).collect()),
    });
    assert_eq!(decode(&encode(&tokens).unwrap()).unwrap(), tokens);
    let reply = Message::StepReply(StepReply {
        entries: (0..n as u32).map(|i| StepEntry { slot: i, base: i }).collect(),
        out: StepOut::Ids {
            ids: (0..n as u32).collect(),
            topk: (0..n)
                .map(|i| (0..MAX_TOPK).map(|k| (k, i as f32 - k as f32)).collect())
                .collect(),
        },
    });
    assert_eq!(decode(&encode(&reply).unwrap()).unwrap(), reply);
    let chain = HelloReply {
        chain: (0..MAX_STAGES)
            .map(|i| StageDesc {
                name: "n".repeat(MAX_NAME),
                ..stage("", i, i + 1)
            })
            .collect(),
        proof: Some([0; 32]),
    };
    let msg = Message::HelloReply(chain);
    assert_eq!(decode(&encode(&msg).unwrap()).unwrap(), msg);
}

#[test]
fn a_foreign_version_is_named_with_both_numbers() {
    let mut bytes = encode(&Message::Ping { seq: 1 }).unwrap();
    bytes[4..8].copy_from_slice(&(VERSION + 1).to_le_bytes());
    assert_eq!(frame::foreign_version(&bytes), Some(VERSION + 1));
    let e = decode(&bytes).unwrap_err().to_string();
    assert!(
        e.contains(&format!("version {}", VERSION + 1)) && e.contains(&format!("version {VERSION}")),
        "{e}"
    );
    assert_eq!(frame::foreign_version(&encode(&Message::Close).unwrap()), None);
    assert_eq!(frame::foreign_version(b"HTTP/1.1"), None);
}

#[test]
fn hmac_primitive_matches_the_published_vector() {
    // RFC 4231 test case 2.
    let mac = auth::hmac_sha256(b"Jefe", b"what do ya want for nothing?").unwrap();
    let want = "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843";
    let got: String = mac.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(got, want);
}

#[test]
fn proofs_bind_secret_role_and_transcript() {
    let hello = ClientHello {
        nonce: auth::nonce().unwrap(),
        name: "head".into(),
        takeover: false,
        has_secret: true,
    };
    let challenge = Challenge {
        nonce: auth::nonce().unwrap(),
        has_secret: true,
    };
    assert_ne!(hello.nonce, challenge.nonce, "two OS nonces collided");
    let t = auth::client_transcript(&hello, &challenge).unwrap();
    let p = auth::prove(b"s3cret", Role::Client, &t).unwrap();
    assert!(auth::verify(b"s3cret", Role::Client, &t, &p).unwrap());
    assert!(
        !auth::verify(b"other", Role::Client, &t, &p).unwrap(),
        "wrong secret accepted"
    );
    assert!(
        !auth::verify(b"s3cret", Role::Worker, &t, &p).unwrap(),
        "a client proof passed as the worker's"
    );
    let other_nonce = Challenge {
        nonce: [0; 32],
        ..challenge.clone()
    };
    let t2 = auth::client_transcript(&hello, &other_nonce).unwrap();
    assert!(
        !auth::verify(b"s3cret", Role::Client, &t2, &p).unwrap(),
        "replayed against another nonce"
    );
    let chain = vec![stage("w", 20, 48)];
    let tw = auth::worker_transcript(&hello, &challenge, &chain).unwrap();
    let pw = auth::prove(b"s3cret", Role::Worker, &tw).unwrap();
    let forged = vec![StageDesc {
        slots: 64,
        ..stage("w", 20, 48)
    }];
    let tf = auth::worker_transcript(&hello, &challenge, &forged).unwrap();
    assert!(
        !auth::verify(b"s3cret", Role::Worker, &tf, &pw).unwrap(),
        "proof survived a changed chain"
    );
}

fn chain_error(own: &StageDesc, rest: &[StageDesc]) -> String {
    check_chain(own, rest).unwrap_err().to_string()
}

#[test]
fn chain_check_accepts_a_good_chain_and_names_each_failure() {
    let head = StageDesc {
        slots: 2,
        ctx: 4096,
        ..stage("head", 0, 20)
    };
    let good = [stage("w1", 20, 30), stage("w2", 30, 48)];
    check_chain(&head, &good).unwrap();
    assert_eq!(
        chain_snapshot_entries(
            &StageDesc {
                snap_entries: 3,
                ..head.clone()
            },
            &good
        ),
        3
    );

    let e = chain_error(&head, &[stage("w1", 22, 48)]);
    assert!(
        e.contains("stage 2 'w1' starts at layer 22") && e.contains("[20, 22) unserved after 'head'"),
        "{e}"
    );
    let e = chain_error(&head, &[stage("w1", 18, 48)]);
    assert!(
        e.contains("starts at layer 18, overlapping 'head' which ends at 20"),
        "{e}"
    );
    let e = chain_error(&head, &[stage("w1", 20, 30)]);
    assert!(
        e.contains("the chain ends at layer 30 (after 'w1'), the model has 48 layers"),
        "{e}"
    );
    let e = chain_error(&head, &[]);
    assert!(e.contains("the chain ends at layer 20 (after 'head')"), "{e}");
    let e = chain_error(
        &head,
        &[
            stage("w1", 20, 30),
            StageDesc {
                fingerprint: "abc".into(),
                ..stage("w2", 30, 48)
            },
        ],
    );
    assert!(
        e.contains("stage 3 'w2' serves model fingerprint abc, 'head' serves 9f86d0"),
        "{e}"
    );
    let e = chain_error(
        &head,
        &[StageDesc {
            n_embd: 4096,
            ..stage("w1", 20, 48)
        }],
    );
    assert!(e.contains("stage 2 'w1' has n_embd 4096, 'head' has 2048"), "{e}");
    let e = chain_error(
        &head,
        &[StageDesc {
            n_layer: 40,
            ..stage("w1", 20, 40)
        }],
    );
    assert!(e.contains("has n_layer 40, 'head' has 48"), "{e}");
    let e = chain_error(
        &head,
        &[StageDesc {
            slots: 1,
            ..stage("w1", 20, 48)
        }],
    );
    assert!(
        e.contains("stage 2 'w1' has 1 slots, fewer than the 2 of 'head'"),
        "{e}"
    );
    let e = chain_error(
        &head,
        &[StageDesc {
            ctx: 2048,
            ..stage("w1", 20, 48)
        }],
    );
    assert!(
        e.contains("stage 2 'w1' has ctx 2048 per slot, less than the 4096 of 'head'"),
        "{e}"
    );
    let e = chain_error(&head, &[stage("w1", 20, 20), stage("w2", 20, 48)]);
    assert!(
        e.contains("stage 2 'w1' has layer range [20, 20) of 48 layers"),
        "{e}"
    );
    let e = chain_error(&head, &[stage("w1", 20, 50)]);
    assert!(e.contains("[20, 50) of 48 layers"), "{e}");
    let e = chain_error(&stage("head", 0, 0), &good);
    assert!(e.contains("'head' has layer range [0, 0)"), "{e}");
    assert!(e.starts_with("chain refused: "), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Loopback sockets. `TestWorker` is a test double of a worker: the real serve loop (engine + chain)
// comes later; this one runs the real handshake and gate, then answers RUN with ids = token + 1.

fn quick() -> Timeouts {
    Timeouts {
        connect: Duration::from_secs(2),
        hello: Duration::from_secs(5),
        pre_auth: Duration::from_secs(5),
        base: Duration::from_secs(5),
        per_row: Duration::from_millis(1),
        spin: Duration::ZERO,
    }
}

#[derive(Clone)]
struct TestWorkerConfig {
    name: &'static str,
    secret: Option<&'static [u8]>,
    chain: Vec<StageDesc>,
    connections: usize,
}

struct TestWorker {
    addr: String,
    /// One line per connection: "served N" or the error that ended it.
    log: JoinHandle<Vec<String>>,
}

/// Serve one connection the way a worker would: handshake, gate, then echo requests.
fn test_worker_session(mut conn: Conn, cfg: &TestWorkerConfig, gate: &SessionGate) -> String {
    let server = ServerConfig {
        name: cfg.name,
        secret: cfg.secret,
    };
    let hs = match ServerHandshake::start(&mut conn, &server) {
        Ok(hs) => hs,
        Err(e) => return e.to_string(),
    };
    let ticket = match gate.begin(cfg.name, hs.hello()) {
        Ok(ticket) => ticket,
        Err(busy) => return hs.refuse(&mut conn, busy).to_string(),
    };
    if let Err(e) = hs.finish(&mut conn, cfg.chain.clone()) {
        return e.to_string();
    }
    let mut served = 0;
    loop {
        // As the real worker: between requests, a takeover ends the session with its notice.
        let ready = match conn.readable_within(Duration::from_millis(20)) {
            Ok(ready) => ready,
            Err(e) => return e.to_string(),
        };
        if let Some(takeover) = ticket.taken_over() {
            conn.refuse(&takeover.error(cfg.name));
            return format!("taken over after {served}");
        }
        if !ready {
            continue;
        }
        let reply = match conn.recv(None) {
            Ok(Message::Close) => return format!("served {served}"),
            Ok(Message::Error(e)) => return e.to_string(),
            Ok(Message::Ping { seq }) => Message::Pong { seq },
            Ok(Message::Run(run)) => match run.rows {
                Rows::Tokens(ids) => Message::RunReply(RunReply {
                    slot: run.slot,
                    base: run.base,
                    out: RunOut::Ids {
                        ids: ids.iter().map(|t| t + 1).collect(),
                        topk: vec![],
                    },
                }),
                Rows::Hidden(_) => Message::Error(ErrorMsg::new(ErrorCode::Stage, cfg.name, "hidden rows")),
            },
            Ok(other) => Message::Error(ErrorMsg::new(
                ErrorCode::BadFrame,
                cfg.name,
                format!("{:?}", other.op()),
            )),
            Err(e) => return e.to_string(),
        };
        if let Err(e) = conn.send(&reply) {
            return e.to_string();
        }
        served += 1;
    }
}

/// Accept `connections` connections; each session on its own thread (so busy/takeover can happen).
fn spawn_test_worker(cfg: TestWorkerConfig) -> TestWorker {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let log = thread::spawn(move || {
        let gate = SessionGate::new();
        let mut sessions = Vec::new();
        for _ in 0..cfg.connections {
            let conn = Conn::accept(&listener, quick()).unwrap();
            let (cfg, gate) = (cfg.clone(), gate.clone());
            sessions.push(thread::spawn(move || test_worker_session(conn, &cfg, &gate)));
            // Let sessions start in accept order so the gate sees them in order.
            thread::sleep(Duration::from_millis(20));
        }
        sessions.into_iter().map(|s| s.join().unwrap()).collect()
    });
    TestWorker { addr, log }
}

fn worker_cfg(secret: Option<&'static [u8]>, connections: usize) -> TestWorkerConfig {
    TestWorkerConfig {
        name: "w1",
        secret,
        chain: vec![stage("w1", 20, 48)],
        connections,
    }
}

fn client<'a>(name: &'a str, secret: Option<&'a [u8]>, own: Option<&'a StageDesc>) -> ClientConfig<'a> {
    ClientConfig {
        name,
        secret,
        takeover: false,
        own,
    }
}

#[test]
fn loopback_session_hello_requests_ping_close() {
    let worker = spawn_test_worker(worker_cfg(None, 1));
    let head = stage("head", 0, 20);
    let mut conn = Conn::connect(&worker.addr, quick()).unwrap();
    assert!(conn.nodelay().unwrap() && conn.keepalive().unwrap());
    let chain = conn.client_hello(&client("head", None, Some(&head))).unwrap();
    assert_eq!(chain, vec![stage("w1", 20, 48)]);
    assert_eq!(
        conn.limits().max_width,
        2048,
        "the hello tightens the row width to n_embd"
    );
    let reply = conn.request(&Message::Run(Run {
        slot: 1,
        base: 0,
        topk: 0,
        rows: Rows::Tokens(vec![10, 20]),
    }));
    assert_eq!(
        reply.unwrap(),
        Message::RunReply(RunReply {
            slot: 1,
            base: 0,
            out: RunOut::Ids {
                ids: vec![11, 21],
                topk: vec![]
            }
        })
    );
    assert!(conn.ping(5).unwrap() < Duration::from_secs(1));
    let e = conn
        .request(&Message::Save { slot: 0, idx: 1 })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bad frame: stage 'w1'") && conn.peer_error().is_some(),
        "{e}"
    );
    conn.close();
    assert_eq!(worker.log.join().unwrap(), vec!["served 3"]);
}

fn hello_both_ends(
    worker_secret: Option<&'static [u8]>,
    head_secret: Option<&'static [u8]>,
) -> (String, String) {
    let worker = spawn_test_worker(worker_cfg(worker_secret, 1));
    let mut conn = Conn::connect(&worker.addr, quick()).unwrap();
    let head = match conn.client_hello(&client("head", head_secret, None)) {
        Ok(_) => {
            conn.close();
            "ok".to_string()
        }
        Err(e) => e.to_string(),
    };
    drop(conn);
    (head, worker.log.join().unwrap().remove(0))
}

#[test]
fn shared_secret_accepts_the_same_secret_and_refuses_everything_else_on_both_ends() {
    let (head, worker) = hello_both_ends(Some(b"s3cret"), Some(b"s3cret"));
    assert_eq!((head.as_str(), worker.as_str()), ("ok", "served 0"));
    let (head, worker) = hello_both_ends(None, None);
    assert_eq!((head.as_str(), worker.as_str()), ("ok", "served 0"));
    for (w, h, why) in [
        (Some(&b"s3cret"[..]), Some(&b"wrong"[..]), "does not match"),
        (Some(&b"s3cret"[..]), None, "requires a shared secret"),
        (None, Some(&b"s3cret"[..]), "not on the worker"),
    ] {
        let (head, worker) = hello_both_ends(w, h);
        assert!(head.contains("authentication failed"), "head: {head}");
        assert!(worker.contains("authentication failed"), "worker: {worker}");
        assert!(
            head.contains(why) || worker.contains(why),
            "{why:?} in neither: {head} / {worker}"
        );
        for text in [&head, &worker] {
            assert!(
                !text.contains("s3cret") && !text.contains("wrong"),
                "a secret leaked into {text}"
            );
        }
    }
}

#[test]
fn a_worker_with_a_bad_proof_is_refused_by_the_head() {
    // A fake worker (a test double): proper challenge, then a reply whose proof is garbage.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let fake = thread::spawn(move || {
        let mut conn = Conn::accept(&listener, quick()).unwrap();
        let Ok(Message::Hello(_)) = conn.recv(Some(Duration::from_secs(5))) else {
            return "no hello".into();
        };
        conn.send(&Message::Challenge(Challenge {
            nonce: [5; 32],
            has_secret: true,
        }))
        .unwrap();
        let Ok(Message::Proof(_)) = conn.recv(Some(Duration::from_secs(5))) else {
            return "no proof".into();
        };
        let reply = HelloReply {
            chain: vec![stage("w1", 20, 48)],
            proof: Some([0xAB; 32]),
        };
        conn.send(&Message::HelloReply(reply)).unwrap();
        match conn.recv(Some(Duration::from_secs(5))) {
            Ok(Message::Error(e)) => e.to_string(),
            other => format!("{other:?}"),
        }
    });
    let mut conn = Conn::connect(&addr, quick()).unwrap();
    let e = conn
        .client_hello(&client("head", Some(b"s3cret"), None))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("authentication failed: the worker's proof does not match"),
        "{e}"
    );
    let seen = fake.join().unwrap();
    assert!(seen.starts_with("authentication failed: stage 'head'"), "{seen}");
}

#[test]
fn version_mismatch_is_answered_with_both_versions_in_both_directions() {
    // A head from the future: the worker answers with an ERROR naming both versions and closes.
    let worker = spawn_test_worker(worker_cfg(None, 1));
    let mut stream = TcpStream::connect(&worker.addr).unwrap();
    let mut hello = encode(&Message::Hello(ClientHello {
        nonce: [1; 32],
        name: "new".into(),
        takeover: false,
        has_secret: false,
    }))
    .unwrap();
    hello[4..8].copy_from_slice(&(VERSION + 1).to_le_bytes());
    let start = Instant::now();
    std::io::Write::write_all(&mut stream, &hello).unwrap();
    let mut reply = Vec::new();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    std::io::Read::read_to_end(&mut stream, &mut reply).unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "the refusal took {:?}",
        start.elapsed()
    );
    let Message::Error(e) = decode(&reply).unwrap() else {
        panic!("not an error")
    };
    assert_eq!(e.code, ErrorCode::Version);
    let both = format!(
        "the peer speaks version {}, this worker speaks version {VERSION}",
        VERSION + 1
    );
    assert!(e.message.contains(&both), "{e}");
    drop(stream);
    let worker_side = worker.log.join().unwrap().remove(0);
    assert!(worker_side.contains(&both), "{worker_side}");

    // A worker from the future: the head names both versions as soon as the reply header arrives.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let fake = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut head = [0u8; HEADER_LEN];
        std::io::Read::read_exact(&mut s, &mut head).unwrap();
        let mut err = encode(&Message::Error(ErrorMsg::new(
            ErrorCode::Version,
            "old",
            "mismatch",
        )))
        .unwrap();
        err[4..8].copy_from_slice(&(VERSION + 7).to_le_bytes());
        std::io::Write::write_all(&mut s, &err).unwrap();
        thread::sleep(Duration::from_millis(200));
    });
    let mut conn = Conn::connect(&addr, quick()).unwrap();
    let e = conn
        .client_hello(&client("head", None, None))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("version {}", VERSION + 7)) && e.contains(&format!("version {VERSION}")),
        "{e}"
    );
    fake.join().unwrap();
}

#[test]
fn one_head_session_busy_then_takeover_then_free() {
    let worker = spawn_test_worker(worker_cfg(Some(b"k"), 4));
    let hello = |name: &str, takeover: bool| -> (Conn, Result<Vec<StageDesc>, String>) {
        let mut conn = Conn::connect(&worker.addr, quick()).unwrap();
        let cfg = ClientConfig {
            name,
            secret: Some(b"k"),
            takeover,
            own: None,
        };
        let r = conn.client_hello(&cfg).map_err(|e| e.to_string());
        (conn, r)
    };
    let (mut a, ra) = hello("head-a", false);
    ra.unwrap();
    let (b, rb) = hello("head-b", false);
    drop(b);
    let e = rb.unwrap_err();
    assert!(
        e.contains("busy: stage 'w1': a head session is live (from 'head-a')"),
        "{e}"
    );
    let (mut c, rc) = hello("head-c", true);
    rc.unwrap();
    // The taken-over session ends with a notice naming who took it over, and when.
    let ping = Message::Ping { seq: 1 };
    let e = a
        .request(&ping)
        .expect_err("head-a still served after a takeover")
        .to_string();
    assert!(
        e.contains("session taken over: stage 'w1': taken over by head 'head-c' at 20"),
        "{e}"
    );
    assert_eq!(a.peer_error().map(|p| p.code), Some(ErrorCode::TakenOver));
    drop(a);
    assert!(matches!(c.request(&ping).unwrap(), Message::Pong { seq: 1 }));
    c.close();
    // The gate frees when the session ends: a plain hello is admitted again.
    thread::sleep(Duration::from_millis(100));
    let (mut d, rd) = hello("head-d", false);
    rd.unwrap();
    d.close();
    let log = worker.log.join().unwrap();
    assert!(log[1].contains("refused head-b: busy"), "{log:?}");
    assert_eq!(
        (log[2].as_str(), log[3].as_str()),
        ("served 1", "served 0"),
        "{log:?}"
    );
}

#[test]
fn chain_refused_by_the_head_reaches_the_worker_too() {
    let cfg = TestWorkerConfig {
        chain: vec![stage("w1", 22, 48)],
        ..worker_cfg(None, 1)
    };
    let worker = spawn_test_worker(cfg);
    let head = stage("head", 0, 20);
    let mut conn = Conn::connect(&worker.addr, quick()).unwrap();
    let e = conn
        .client_hello(&client("head", None, Some(&head)))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("chain refused: stage 2 'w1' starts at layer 22"),
        "{e}"
    );
    let seen = worker.log.join().unwrap().remove(0);
    assert!(
        seen.contains("chain refused: stage 'head'") && seen.contains("starts at layer 22"),
        "{seen}"
    );
}

#[test]
fn a_bad_frame_ends_that_connection_and_the_worker_serves_the_next() {
    let worker = spawn_test_worker(worker_cfg(None, 2));
    let mut garbage = TcpStream::connect(&worker.addr).unwrap();
    std::io::Write::write_all(
        &mut garbage,
        b"GET / HTTP/1.1\r\nHost: worker.example\r\nAccept: */*\r\n\r\n",
    )
    .unwrap();
    let mut reply = Vec::new();
    garbage.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    std::io::Read::read_to_end(&mut garbage, &mut reply).unwrap();
    let Message::Error(e) = decode(&reply).unwrap() else {
        panic!("not an error")
    };
    assert_eq!(e.code, ErrorCode::BadFrame);
    drop(garbage);
    let mut conn = Conn::connect(&worker.addr, quick()).unwrap();
    conn.client_hello(&client("head", None, None)).unwrap();
    conn.close();
    let log = worker.log.join().unwrap();
    assert!(log[0].contains("bad frame: magic"), "{log:?}");
    assert_eq!(log[1], "served 0");
}

#[test]
fn a_stalled_peer_times_out_within_the_row_scaled_deadline() {
    // A test double that announces 200 rows and then never sends them.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stall = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let h = Header {
            op: Op::RunReply,
            flags: 0,
            slot: 0,
            n: 200,
            base: 0,
            arg: 0,
            width: 0,
            len: 800,
        };
        std::io::Write::write_all(&mut s, &frame::encode_header(&h)).unwrap();
        thread::sleep(Duration::from_millis(1500));
    });
    let timeouts = Timeouts {
        base: Duration::from_millis(300),
        per_row: Duration::from_millis(2),
        ..quick()
    };
    let mut conn = Conn::connect(&addr, timeouts).unwrap();
    let start = Instant::now();
    let e = conn.recv(Some(Duration::from_secs(2))).unwrap_err().to_string();
    let took = start.elapsed();
    // 300 ms + 200 × 2 ms = 700 ms; the bound leaves room for a loaded 2-core machine.
    assert!(
        e.contains("timed out reading a run_reply payload (0 of 800 bytes)"),
        "{e}"
    );
    assert!(
        took >= Duration::from_millis(650) && took < Duration::from_millis(2500),
        "{took:?}"
    );
    // Waiting for the first byte of a message has its own limit.
    let e = conn
        .recv(Some(Duration::from_millis(100)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("waiting for a message") || e.contains("closed"), "{e}");
    stall.join().unwrap();
}

#[test]
fn flags_and_hello_fields_survive_the_wire() {
    // Both flag bits on a hello, decoded back into the typed fields.
    let hello = ClientHello {
        nonce: [2; 32],
        name: "h".into(),
        takeover: true,
        has_secret: true,
    };
    let bytes = encode(&Message::Hello(hello.clone())).unwrap();
    assert_eq!(
        u16::from_le_bytes([bytes[10], bytes[11]]),
        FLAG_TAKEOVER | FLAG_SECRET
    );
    assert_eq!(decode(&bytes).unwrap(), Message::Hello(hello));
}

// A relaying test double: the middle stage of head → w1 → w2. It does what the real worker will do
// with this API: authenticate the head, take the gate, open its own downstream hello (passing the
// takeover on), answer with its own description plus the downstream chain — or relay the downstream's
// refusal with the downstream stage's name intact — then forward RUNs and relay the replies.
struct RelayConfig {
    own: StageDesc,
    secret: Option<&'static [u8]>,
    down_secret: Option<&'static [u8]>,
    next: String,
}

fn relay_session(mut conn: Conn, cfg: &RelayConfig, gate: &SessionGate) -> String {
    let name = cfg.own.name.clone();
    let hs = match ServerHandshake::start(
        &mut conn,
        &ServerConfig {
            name: &name,
            secret: cfg.secret,
        },
    ) {
        Ok(hs) => hs,
        Err(e) => return e.to_string(),
    };
    let _ticket = match gate.begin(&name, hs.hello()) {
        Ok(t) => t,
        Err(busy) => return hs.refuse(&mut conn, busy).to_string(),
    };
    let down_cfg = ClientConfig {
        name: &name,
        secret: cfg.down_secret,
        takeover: hs.hello().takeover,
        own: Some(&cfg.own),
    };
    let mut down = match Conn::connect(&cfg.next, quick()) {
        Ok(d) => d,
        Err(e) => {
            return hs
                .refuse(
                    &mut conn,
                    ErrorMsg::new(ErrorCode::Unavailable, &name, e.to_string()),
                )
                .to_string();
        }
    };
    let chain = match down.client_hello(&down_cfg) {
        Ok(chain) => chain,
        Err(e) => {
            let relayed = down
                .peer_error()
                .cloned()
                .unwrap_or_else(|| ErrorMsg::new(ErrorCode::Chain, &name, e.to_string()));
            return hs.refuse(&mut conn, relayed).to_string();
        }
    };
    let mut full = vec![cfg.own.clone()];
    full.extend(chain);
    if let Err(e) = hs.finish(&mut conn, full) {
        return e.to_string();
    }
    let mut relayed = 0;
    loop {
        let reply = match conn.recv(None) {
            Ok(Message::Close) => {
                down.close();
                return format!("relayed {relayed}");
            }
            Ok(req @ Message::Run(_)) => match down.request(&req) {
                Ok(reply) => reply,
                Err(e) => Message::Error(
                    down.peer_error()
                        .cloned()
                        .unwrap_or_else(|| ErrorMsg::new(ErrorCode::Unavailable, &name, e.to_string())),
                ),
            },
            Ok(other) => Message::Error(ErrorMsg::new(
                ErrorCode::BadFrame,
                &name,
                format!("{:?}", other.op()),
            )),
            Err(e) => return e.to_string(),
        };
        if conn.send(&reply).is_err() {
            return "upstream gone".into();
        }
        relayed += 1;
    }
}

fn spawn_relay(cfg: RelayConfig) -> TestWorker {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let log = thread::spawn(move || {
        let conn = Conn::accept(&listener, quick()).unwrap();
        vec![relay_session(conn, &cfg, &SessionGate::new())]
    });
    TestWorker { addr, log }
}

#[test]
fn a_three_stage_chain_relays_its_description_and_requests() {
    let last = spawn_test_worker(TestWorkerConfig {
        name: "w2",
        secret: Some(b"k2"),
        chain: vec![stage("w2", 30, 48)],
        connections: 1,
    });
    let middle = spawn_relay(RelayConfig {
        own: stage("w1", 20, 30),
        secret: Some(b"k1"),
        down_secret: Some(b"k2"),
        next: last.addr.clone(),
    });
    let head = stage("head", 0, 20);
    let mut conn = Conn::connect(&middle.addr, quick()).unwrap();
    let chain = conn
        .client_hello(&client("head", Some(b"k1"), Some(&head)))
        .unwrap();
    let names: Vec<&str> = chain.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["w1", "w2"]);
    let run = Message::Run(Run {
        slot: 0,
        base: 0,
        topk: 0,
        rows: Rows::Tokens(vec![7, 8, 9]),
    });
    let Message::RunReply(reply) = conn.request(&run).unwrap() else {
        panic!("not a run reply")
    };
    assert_eq!(
        reply.out,
        RunOut::Ids {
            ids: vec![8, 9, 10],
            topk: vec![]
        }
    );
    conn.close();
    assert_eq!(middle.log.join().unwrap(), ["relayed 1"]);
    assert_eq!(last.log.join().unwrap(), ["served 1"]);
}

#[test]
fn a_downstream_refusal_reaches_the_head_with_the_downstream_stage_named() {
    // The middle stage holds the wrong secret for the last one: the last stage refuses the middle,
    // and the head reads that refusal with "w2" on it.
    let last = spawn_test_worker(TestWorkerConfig {
        name: "w2",
        secret: Some(b"k2"),
        chain: vec![stage("w2", 30, 48)],
        connections: 1,
    });
    let middle = spawn_relay(RelayConfig {
        own: stage("w1", 20, 30),
        secret: None,
        down_secret: Some(b"stale"),
        next: last.addr.clone(),
    });
    let mut conn = Conn::connect(&middle.addr, quick()).unwrap();
    let e = conn
        .client_hello(&client("head", None, None))
        .unwrap_err()
        .to_string();
    assert!(e.contains("authentication failed: stage 'w2'"), "{e}");
    assert_eq!(
        conn.peer_error().map(|p| (p.code, p.stage.as_str())),
        Some((ErrorCode::Auth, "w2"))
    );
    drop(conn);
    let middle_log = middle.log.join().unwrap().remove(0);
    assert!(
        middle_log.contains("refused head: authentication failed: stage 'w2'"),
        "{middle_log}"
    );
    assert!(last.log.join().unwrap()[0].contains("authentication failed"));

    // A last stage that does not continue the middle's range: the middle refuses with its own name.
    let last = spawn_test_worker(TestWorkerConfig {
        name: "w2",
        secret: None,
        chain: vec![stage("w2", 31, 48)],
        connections: 1,
    });
    let middle = spawn_relay(RelayConfig {
        own: stage("w1", 20, 30),
        secret: None,
        down_secret: None,
        next: last.addr.clone(),
    });
    let mut conn = Conn::connect(&middle.addr, quick()).unwrap();
    let e = conn
        .client_hello(&client("head", None, None))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("chain refused: stage 'w1'") && e.contains("stage 2 'w2' starts at layer 31"),
        "{e}"
    );
    drop(conn);
    middle.log.join().unwrap();
    last.log.join().unwrap();
}

#[test]
fn hidden_rows_travel_bit_exact_including_non_finite_values() {
    let data = vec![
        f32::NAN,
        f32::from_bits(0x7fa0_0001),
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.0,
        f32::MIN_POSITIVE / 2.0,
    ];
    let msg = Message::Run(Run {
        slot: 0,
        base: 0,
        topk: 0,
        rows: Rows::Hidden(HiddenRows {
            width: 3,
            data: data.clone(),
        }),
    });
    let Message::Run(back) = decode(&encode(&msg).unwrap()).unwrap() else {
        panic!("not a run")
    };
    let Rows::Hidden(rows) = back.rows else {
        panic!("not hidden rows")
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&rows.data), bits(&data));
}

/// A recording proxy (test double) between a head and a worker: forwards bytes both ways and keeps a
/// copy of everything that crossed.
fn spawn_recording_proxy(target: String) -> (String, JoinHandle<Vec<u8>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let handle = thread::spawn(move || {
        let (client, _) = listener.accept().unwrap();
        let server = TcpStream::connect(&target).unwrap();
        let pump = |mut from: TcpStream, mut to: TcpStream| {
            thread::spawn(move || {
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    match std::io::Read::read(&mut from, &mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(k) => {
                            seen.extend_from_slice(&buf[..k]);
                            if std::io::Write::write_all(&mut to, &buf[..k]).is_err() {
                                break;
                            }
                        }
                    }
                }
                let _ = to.shutdown(std::net::Shutdown::Write);
                seen
            })
        };
        let up = pump(client.try_clone().unwrap(), server.try_clone().unwrap());
        let down = pump(server, client);
        let mut all = up.join().unwrap();
        all.extend(down.join().unwrap());
        all
    });
    (addr, handle)
}

#[test]
fn the_shared_secret_never_crosses_the_wire() {
    let secret: &'static [u8] = b"correct horse battery staple";
    let worker = spawn_test_worker(worker_cfg(Some(secret), 1));
    let (proxy, recorded) = spawn_recording_proxy(worker.addr.clone());
    let mut conn = Conn::connect(&proxy, quick()).unwrap();
    conn.client_hello(&client("head", Some(secret), None)).unwrap();
    conn.ping(1).unwrap();
    conn.close();
    drop(conn);
    assert_eq!(worker.log.join().unwrap(), ["served 1"]);
    let wire = recorded.join().unwrap();
    assert!(
        wire.len() > 2 * HEADER_LEN + 2 * 32,
        "the proxy saw only {} bytes",
        wire.len()
    );
    assert!(
        !wire.windows(secret.len()).any(|w| w == secret),
        "the secret appeared on the wire"
    );
    // Nor does any 8-byte piece of it.
    assert!(!secret.windows(8).any(|piece| wire.windows(8).any(|w| w == piece)));
}

#[test]
fn takeover_times_are_rfc3339_utc() {
    use qk::transport::conn::utc_timestamp;
    use std::time::{SystemTime, UNIX_EPOCH};
    let at = |secs: u64| utc_timestamp(UNIX_EPOCH + Duration::from_secs(secs));
    assert_eq!(at(0), "1970-01-01T00:00:00Z");
    assert_eq!(at(951_782_400), "2000-02-29T00:00:00Z");
    assert_eq!(at(1_709_251_199), "2024-02-29T23:59:59Z");
    assert_eq!(at(4_102_444_800), "2100-01-01T00:00:00Z");
    assert_eq!(
        utc_timestamp(SystemTime::UNIX_EPOCH - Duration::from_secs(5)),
        "1970-01-01T00:00:00Z"
    );
}

#[test]
fn a_spinning_wait_reads_what_a_sleeping_one_does_and_keeps_its_limits() {
    // A peer answering each PING after a pause: none, longer than the spin (the wait goes on
    // asleep), none; then never again.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let peer = thread::spawn(move || {
        let mut conn = Conn::accept(&listener, quick()).unwrap();
        for pause in [0u64, 60, 0] {
            let Message::Ping { seq } = conn.recv(None).unwrap() else {
                panic!("not a ping")
            };
            thread::sleep(Duration::from_millis(pause));
            conn.send(&Message::Pong { seq }).unwrap();
        }
        conn.recv(None).unwrap()
    });
    let spin = Duration::from_millis(20);
    let mut conn = Conn::connect(&addr, Timeouts { spin, ..quick() }).unwrap();
    assert!(
        !conn.spin_until_readable(Duration::from_millis(5)),
        "nothing sent yet"
    );
    for seq in 0..3 {
        let rtt = conn.ping(seq).unwrap();
        if seq == 1 {
            assert!(rtt >= Duration::from_millis(60), "{rtt:?}");
        }
    }
    // Past the spin, the wait is the blocking one with its own limit.
    let start = Instant::now();
    let e = conn
        .recv(Some(Duration::from_millis(150)))
        .unwrap_err()
        .to_string();
    let took = start.elapsed();
    assert!(e.contains("waiting for a message"), "{e}");
    assert!(
        took >= Duration::from_millis(140) && took < Duration::from_secs(2),
        "{took:?}"
    );
    conn.send(&Message::Close).unwrap();
    assert_eq!(peer.join().unwrap(), Message::Close);
}

#[test]
fn a_peer_that_closes_while_the_wait_polls_is_reported_at_once() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let peer = thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        thread::sleep(Duration::from_millis(20));
        drop(s);
    });
    let mut conn = Conn::connect(
        &addr,
        Timeouts {
            spin: Duration::from_secs(5),
            ..quick()
        },
    )
    .unwrap();
    let start = Instant::now();
    let e = conn.recv(Some(Duration::from_secs(5))).unwrap_err().to_string();
    assert!(e.contains("closed"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(2), "{:?}", start.elapsed());
    peer.join().unwrap();
}
