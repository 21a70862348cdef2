//! Model config and engine tests on the committed fixtures: layer plan and hyper-parameters (no
//! GPU), and the engine's position rules and output shapes (GPU; without an adapter they print a
//! note and pass unless QK_REQUIRE_GPU=1).

use std::path::PathBuf;

use qk::QkError;
use qk::engine::{Engine, EngineOptions, StageInput, StageOutput};
use qk::gguf::GgufFile;
use qk::model::{Arch, LayerKind, ModelConfig};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("{name}.gguf"))
}

#[test]
fn config_of_small_fixture() {
    let cfg = ModelConfig::from_gguf(&GgufFile::open(fixture("tiny-qwen3next-f32")).unwrap()).unwrap();
    assert_eq!(cfg.arch, Arch::Qwen3Next);
    assert_eq!((cfg.n_layer, cfg.n_mtp, cfg.n_embd, cfg.vocab), (4, 0, 64, 465));
    use LayerKind::{Attention as A, DeltaNet as D};
    assert_eq!(cfg.kinds, vec![D, D, D, A]);
    assert_eq!((cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.n_rot), (4, 2, 32, 8));
    assert_eq!((cfg.k_heads, cfg.v_heads, cfg.dk, cfg.dv), (2, 4, 16, 16));
    assert_eq!(cfg.conv_dim(), 2 * 2 * 16 + 4 * 16);
    assert!((cfg.attn_scale - 1.0 / 32f32.sqrt()).abs() < 1e-7);
}

#[test]
fn config_of_quantised_fixture_uses_interval_two() {
    let cfg = ModelConfig::from_gguf(&GgufFile::open(fixture("tiny-qwen35moe-iq4_xs")).unwrap()).unwrap();
    assert_eq!(cfg.arch, Arch::Qwen35Moe);
    assert_eq!(cfg.kinds, vec![LayerKind::DeltaNet, LayerKind::Attention]);
    assert_eq!(
        (cfg.experts, cfg.experts_used, cfg.expert_ff, cfg.shared_ff),
        (4, 2, 256, 256)
    );
    assert_eq!(cfg.rope_base, 1e7);
}

fn engine(layers: Option<(u32, u32)>) -> Option<Engine> {
    let opts = EngineOptions {
        layers,
        slots: 2,
        ctx: 96,
        device: None,
    };
    match Engine::load(
        fixture("tiny-qwen35moe-f32").to_str().unwrap(),
        &opts,
        &mut |_| {},
    ) {
        Ok(e) => Some(e),
        Err(e @ QkError::Device(_)) => {
            assert!(
                std::env::var("QK_REQUIRE_GPU").as_deref() != Ok("1"),
                "QK_REQUIRE_GPU=1 but no device: {e}"
            );
            eprintln!("note: skipping engine test, no device: {e}");
            None
        }
        Err(e) => panic!("load failed: {e}"),
    }
}

#[test]
fn engine_positions_and_outputs() {
    let Some(mut eng) = engine(None) else { return };
    let prompt: Vec<u32> = (0..70).map(|i| (i * 7 + 3) % 456).collect();
    let StageOutput::Ids { ids, topk } = eng.stage_run(0, StageInput::Tokens(&prompt), 0, 5).unwrap() else {
        panic!("last stage returned hidden rows")
    };
    assert_eq!(ids.len(), prompt.len());
    assert_eq!(topk.len(), 5);
    assert_eq!(topk[0].0, ids[69]);
    assert!(topk.windows(2).all(|w| w[0].1 >= w[1].1));
    assert_eq!(eng.position(0).unwrap(), 70);
    // Greedy ids are the argmax of the logits.
    let logits = eng.logits(1, &prompt, 0).unwrap();
    let vocab = eng.config().vocab as usize;
    for (t, &id) in ids.iter().enumerate() {
        let row = &logits[t * vocab..(t + 1) * vocab];
        let best = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(row[id as usize], best, "position {t}");
    }
    // A base that does not continue the slot, positions past ctx, a repeated slot: clear errors.
    let wrong = eng.stage_run(0, StageInput::Tokens(&[1]), 3, 0).unwrap_err();
    assert!(
        matches!(wrong, QkError::Engine(ref m) if m.contains("position 70")),
        "{wrong}"
    );
    let long = eng
        .stage_run(0, StageInput::Tokens(&prompt[..30]), 70, 0)
        .unwrap_err();
    assert!(
        matches!(long, QkError::Engine(ref m) if m.contains("context of 96")),
        "{long}"
    );
    assert!(eng.step(&[1, 1], StageInput::Tokens(&[1, 2]), 0).is_err());
    assert!(eng.stage_run(5, StageInput::Tokens(&[1]), 0, 0).is_err());
}

#[test]
fn first_stage_returns_hidden_rows() {
    let Some(mut eng) = engine(Some((0, 2))) else {
        return;
    };
    let StageOutput::Hidden(h) = eng.stage_run(0, StageInput::Tokens(&[1, 2, 3]), 0, 0).unwrap() else {
        panic!("first stage returned ids")
    };
    assert_eq!(h.len(), 3 * eng.config().n_embd as usize);
    assert!(h.iter().all(|v| v.is_finite()));
    assert!(
        eng.stage_run(0, StageInput::Hidden(&h), 0, 0).is_err(),
        "the first stage takes tokens"
    );
}
