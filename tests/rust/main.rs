//! The one cargo integration-test binary; each area adds a module here.
mod gguf_tests;
mod transport_tests;
mod worker_tests;
