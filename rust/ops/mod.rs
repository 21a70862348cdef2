//! Host side of every kernel: parameters, bindings and dispatch sizes; CPU references for tests.
