//! The panic boundary every Python entry point goes through (`catch_panic`): a panic inside comes back
//! as `QkError::Panic` carrying its message, whatever the payload; results and errors pass through.

use qk::error::{QkError, catch_panic};

#[test]
fn a_panic_becomes_a_typed_error_with_its_message() {
    let hook = std::panic::take_hook();
    // The default hook would print each expected panic; nothing here is a failure.
    std::panic::set_hook(Box::new(|_| {}));
    let overflow = catch_panic(|| {
        let heads: u32 = std::hint::black_box(1 << 31);
        Ok(heads.checked_mul(2).expect("2 × 2^31 heads overflows u32"))
    });
    let formatted = catch_panic::<()>(|| panic!("layer {} of {}", 7, 3));
    let opaque = catch_panic::<()>(|| std::panic::panic_any(42_u8));
    std::panic::set_hook(hook);
    match overflow {
        Err(QkError::Panic(msg)) => assert_eq!(msg, "2 × 2^31 heads overflows u32"),
        other => panic!("expected a panic error, got {other:?}"),
    }
    assert!(
        matches!(formatted, Err(QkError::Panic(ref m)) if m == "layer 7 of 3"),
        "{formatted:?}"
    );
    assert!(
        matches!(opaque, Err(QkError::Panic(ref m)) if m == "a panic without a message"),
        "{opaque:?}"
    );
    let err = QkError::Panic("x".into()).to_string();
    assert_eq!(err, "internal error (a bug in qk): x");
}

#[test]
fn results_and_errors_pass_through() {
    assert_eq!(catch_panic(|| Ok(5)).unwrap(), 5);
    let err = catch_panic::<()>(|| Err(QkError::Engine("bad slot".into()))).unwrap_err();
    assert!(matches!(err, QkError::Engine(ref m) if m == "bad slot"));
}
